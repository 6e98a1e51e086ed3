"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

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
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    multi_modal_data: dict[str, Any] | None = None
    mm_items: list[MultiModalItem] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by a step still running on the device (async scheduling): counted in
        # num_tokens, not yet in all_token_ids.
        self.num_output_placeholders = 0
        # Prompt plus max_tokens, capped by max_model_len: the engine sets it once the prompt is final.
        self.max_num_tokens = sys.maxsize
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.block_table_row: int | None = None  # its row in BlockManager.table while it holds blocks
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.logprobs: list[dict[int, float]] | None = [] if self.sampling_params.logprobs is not None else None
        seed = self.sampling_params.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

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

    def mm_hashes_in(self, start: int, end: int) -> list[str]:
        """Content hashes of the multimodal items overlapping token positions [start, end).

        A prefix-cache block hash must include these, so two prompts with the same placeholder
        tokens but different images never share KV blocks.
        """
        return [m.content_hash for m in self.mm_items if m.offset < end and m.offset + m.length > start]
