"""A request's scheduling state, owned by the scheduler from admission to finish."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any

from hookllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
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
        self.stop_reason: int | str | None = None

    def reset_prompt(self, token_ids: list[int]) -> None:
        """Replace the prompt (a plugin's ``preprocess_request`` expanding placeholders)."""
        self.prompt_token_ids = list(token_ids)
        self.all_token_ids = list(token_ids)

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
