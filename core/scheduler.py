"""Continuous batching: each step, decide how many tokens of which requests to compute.

vLLM v1 style: no separate prefill and decode phases. Running requests go first (a decode is
one token; an unfinished prefill continues its next chunk), then waiting requests are admitted
in arrival order, all under one token budget. When blocks run out, the newest running request
is preempted: its blocks are freed and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from hookllm.block_manager import BlockManager
from hookllm.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's batch: the hooks receive it as ``batch``."""

    requests: list[Request]  # in flat row order
    num_scheduled_tokens: list[int]
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32, from BlockManager.block_tables
    preempted: list[Request] = field(default_factory=list)
    generator: torch.Generator | None = None  # the engine's RNG for unseeded sampling

    def __post_init__(self) -> None:
        # Requests whose chunk reaches their last token sample this step: one logits row each.
        self.sampling_requests: list[Request] = [
            r for r, n in zip(self.requests, self.num_scheduled_tokens)
            if r.num_computed_tokens + n == r.num_tokens
        ]

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_blocks: int
    num_blocks: int

    @property
    def kv_cache_usage(self) -> float:
        """Share of the KV cache's blocks held by requests, 0 to 1."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def stats(self) -> SchedulerStats:
        manager = self.block_manager
        return SchedulerStats(len(self.running), len(self.waiting),
                              manager.num_blocks - manager.num_free_blocks, manager.num_blocks)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_tokens >= request.max_num_tokens:
                i += 1  # its last token is being sampled by the step in flight: nothing left to run
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                counts.append(num_new)
                budget -= num_new
                i += 1

        # Admitting new work right after a preemption would only thrash the cache.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new
        return SchedulerOutput(scheduled, counts, self.block_manager.block_tables(scheduled), preempted)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length or aborted) and free its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request)
