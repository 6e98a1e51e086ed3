"""A request's scheduling state, owned by the scheduler from admission to finish."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any

from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks' contents kept in host memory
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


FINISHED_STATUSES = frozenset(
    (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)


@dataclass
class MultiModalItem:
    """One non-text input occupying ``length`` placeholder tokens from ``offset`` in the prompt."""

    modality: str
    offset: int
    length: int
    content_hash: str
    data: Any = None


@dataclass
class Request:
    """Built by the engine from the user's prompt, adjusted by ``preprocess_request`` hooks, then
    changed only by the scheduler (what each step computes, what its sampled tokens did)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    multi_modal_data: dict[str, Any] | None = None
    mm_items: list[MultiModalItem] = field(default_factory=list)
    # Mixed into the hash of the request's first KV block (so into every block after it): requests
    # share cached blocks only when their salts are equal. From the prompt's "cache_salt"; a plugin
    # whose embeddings or K/V depend on more than the tokens and images sets it in preprocess_request.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by a step still running on the device (async scheduling): counted in
        # num_tokens, not yet in all_token_ids.
        self.num_output_placeholders = 0
        # How many of all_token_ids the model runner has been sent (0: it has not seen the request).
        self.num_synced_tokens = 0
        # Prompt plus max_tokens, capped by max_model_len: the engine sets it once the prompt is final.
        self.max_num_tokens = sys.maxsize
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.block_table_row: int | None = None  # its row in BlockManager.table while it holds blocks
        self.host_block_ids: list[int] = []  # while swapped: where its blocks' K/V wait, in order
        self.stop_reason: int | str | None = None
        # Prefix caching: hashes of the full blocks of all_token_ids (filled lazily by the block
        # manager), how many of the held blocks it made findable, and the first admission's hit.
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None
        # Keep the blocks after finishing, for forks (beam search), until Scheduler.release.
        self.retain_blocks = False

    def reset_prompt(self, token_ids: list[int]) -> None:
        """Replace the prompt (a plugin's ``preprocess_request`` expanding placeholders)."""
        self.prompt_token_ids = list(token_ids)
        self.all_token_ids = list(token_ids)
        self.block_hashes = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


class ParallelGroup:
    """A request with ``n`` > 1, run as ``n`` child requests (``"{i}_{request_id}"``, child ``i``
    seeded ``seed + i``) that share the prompt's cached KV blocks.

    Reported vLLM's way: with ``final_only`` one ``RequestOutput`` holding the ``n`` completions
    (``CompletionOutput.index`` = i) once all finish; with ``cumulative`` / ``delta`` each child's
    progress as its own ``RequestOutput`` under the parent's id, carrying that child's completion
    only, and ``finished`` set on the output of the last child to finish.
    """

    def __init__(self, request_id: str, n: int, output_kind: str):
        self.request_id = request_id
        self.child_ids = [f"{i}_{request_id}" for i in range(n)]
        self.index = {child_id: i for i, child_id in enumerate(self.child_ids)}
        self.output_kind = output_kind
        self.completions: dict[int, CompletionOutput] = {}
        self.num_finished = 0
        self.num_cached_tokens = 0  # the best hit among the children (the first computes the prompt)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.child_ids)

    def add(self, output: RequestOutput) -> RequestOutput | None:
        """A child's output in, the parent's output to report (None while a final one is pending)."""
        completion = output.outputs[0]
        completion.index = self.index[output.request_id]
        self.num_finished += output.finished
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if self.output_kind == "final_only":
            self.completions[completion.index] = completion
            if not self.finished:
                return None
            completions = [self.completions[i] for i in range(len(self.child_ids))]
        else:
            completions = [completion]
        return RequestOutput(self.request_id, output.prompt, output.prompt_token_ids, completions,
                             self.finished, num_cached_tokens=self.num_cached_tokens)
