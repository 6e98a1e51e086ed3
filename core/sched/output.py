"""One step's batch as plain data: what the scheduler decided, for a model runner anywhere.

vLLM v1's shape: a request's prompt, sampling parameters and multimodal inputs cross once, the
first time it is scheduled; after that a step carries only ids, token counts, the output tokens
the runner has not been sent yet, and the block ids its tables lack (a new block every
``block_size`` tokens, not whole tables). Everything pickles, so a runner in another process
rebuilds the step from this alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hookllm.sched.request import MultiModalItem
from hookllm.lora.request import LoRARequest
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: sent once, the first time it is scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_items: list[MultiModalItem] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    request_ids: list[str]  # the scheduled requests, in flat row order
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]  # each request's computed tokens before this step
    new_token_ids: list[list[int]]  # output tokens each request has that the runner was not sent
    sampling_rows: list[int]  # indices into request_ids of the requests that sample this step
    # What the runner's block tables lack (hookllm.worker.input_batch): (index into request_ids,
    # first column, [num groups, n] int32 block ids), the request's tables from that column to
    # their end in every KV cache group (hookllm.worker.kv_cache_groups); column 0 replaces them.
    block_updates: list[tuple[int, int, np.ndarray]]
    # (source, destination) KV blocks to copy before the step runs: copy-on-write of shared blocks.
    # A block id names the same rows of every cache tensor in every group, so a pair is group-free.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # the runner drops their state
    preempted_request_ids: list[str] = field(default_factory=list)  # swapped out or to be recomputed
    # Swapping (preemption_mode="swap"), done by the worker before the step runs, swap-out
    # first: (device, host) blocks whose K/V move to host memory (the device blocks may be
    # reused this step), then (host, device) blocks whose K/V come back; every group's blocks.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Indices into request_ids of the pooling requests whose prompt this step completes: they
    # end with the step, their pooled hidden states their output.
    pooling_rows: list[int] = field(default_factory=list)
    # Speculative decoding: the drafts each request verifies this step (request id -> ids), fed
    # after its last token (counted in num_scheduled_tokens); ``speculates``: the runner proposes
    # drafts after sampling, and the engine reads this step's tokens before scheduling the next.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    speculates: bool = False

    @classmethod
    def empty(cls, finished_request_ids: list[str] | None = None) -> "SchedulerOutput":
        return cls([], [], [], [], [], [], [], finished_request_ids=finished_request_ids or [])

    @property
    def sampling_request_ids(self) -> list[str]:
        return [self.request_ids[row] for row in self.sampling_rows]

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def is_empty(self) -> bool:
        return not self.request_ids
