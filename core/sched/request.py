"""A request's scheduling state: built by the input processor, owned by the scheduler from admission to finish."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any

from hookllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks' contents kept in host memory
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


# A tuple, not a set: ``in`` compares members by identity first, where a set would call the
# enum's Python-level __hash__ (once per running request per step, in the engine's hot loop).
FINISHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


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
    """Built by the input processor from the user's prompt, adjusted by ``preprocess_request``
    hooks, then changed only by the scheduler (what each step computes, what its sampled tokens did)."""

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
        # Prompt plus max_tokens, capped by max_model_len: set_length_limit sets it once the prompt is final.
        self.max_num_tokens = sys.maxsize
        self.status = RequestStatus.WAITING
        # Per KV cache group, its block table: one block per block_size tokens (in a sliding group,
        # those before its window are freed and their entries are the block manager's null
        # block); empty while it holds no blocks.
        self.block_ids: list[list[int]] = []
        self.block_table_row: int | None = None  # its row in BlockManager.table while it holds blocks
        self.host_block_ids: list[list[int]] = []  # while swapped: per group, where its blocks' K/V wait, in order
        self.stop_reason: int | str | None = None
        # Prefix caching: SHA-256 digests of the full blocks of all_token_ids (filled lazily by the
        # block manager), how many of the held blocks it made findable, and the first admission's hit.
        self.block_hashes: list[bytes] = []
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

    def set_length_limit(self, max_model_len: int) -> None:
        """Check the prompt against ``max_model_len`` and set ``max_num_tokens`` (prompt plus
        ``max_tokens``, capped by ``max_model_len``); ``ValueError`` naming the request if it cannot run."""
        rid, n = self.request_id, self.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid}: the prompt is empty")
        if n >= max_model_len:
            raise ValueError(f"request {rid}: the prompt has {n} tokens, max_model_len is {max_model_len} "
                             "(it must leave room for at least one output token)")
        max_tokens = self.sampling_params.max_tokens
        self.max_num_tokens = min(n + max_tokens, max_model_len) if max_tokens is not None else max_model_len

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

