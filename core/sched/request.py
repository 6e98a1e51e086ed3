"""A request's scheduling state: made by the scheduler from an ``EngineCoreRequest`` and owned by it from admission to finish."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hookllm.lora.request import LoRARequest
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hookllm.engine.core_request import EngineCoreRequest


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
    """Made by the scheduler from the engine core's input (``Scheduler.add_request``) and changed
    only by the scheduler (what each step computes, what its sampled tokens did)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    multi_modal_data: dict[str, Any] | None = None
    mm_items: list[MultiModalItem] = field(default_factory=list)
    cache_salt: str | None = None  # mixed into its first KV block's hash (EngineCoreRequest.cache_salt)
    # Prompt plus max_tokens, capped by max_model_len (EngineCoreRequest.set_length_limit).
    max_num_tokens: int = sys.maxsize
    pooling_params: PoolingParams | None = None  # a pooling request: it ends once its prompt is computed
    lora_request: LoRARequest | None = None  # its adapter: keyed into its blocks' hashes, one of max_loras

    def __post_init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by a step still running on the device (async scheduling): counted in
        # num_tokens, not yet in all_token_ids.
        self.num_output_placeholders = 0
        # How many of all_token_ids the model runner has been sent (0: it has not seen the request).
        self.num_synced_tokens = 0
        self.status = RequestStatus.WAITING
        # Its row in BlockManager.table (every KV cache group's block table) while it holds blocks:
        # the block ids themselves are kept there alone (BlockManager.block_ids).
        self.block_table_row: int | None = None
        self.host_block_ids: list[list[int]] = []  # while swapped: per group, where its blocks' K/V wait, in order
        self.stop_reason: int | str | None = None
        # Prefix caching: SHA-256 digests of the full blocks of all_token_ids (filled lazily by the
        # block manager), how many of the held blocks it made findable, and the first admission's hit.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None
        # Keep the blocks after finishing, for forks (beam search), until Scheduler.release.
        self.retain_blocks = False
        # Speculative decoding: the proposer's guesses of the tokens after all_token_ids, scheduled
        # with its next step.
        self.spec_token_ids: list[int] = []

    @classmethod
    def from_core_request(cls, core_request: EngineCoreRequest) -> Request:
        """The scheduling state of an engine request, before its first step."""
        c = core_request
        return cls(c.request_id, c.prompt_token_ids, c.sampling_params, c.prompt, c.multi_modal_data,
                   c.mm_items, c.cache_salt, c.max_num_tokens, c.pooling_params, c.lora_request)

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

