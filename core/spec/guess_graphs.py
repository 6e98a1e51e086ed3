"""CUDA graphs of a model proposer's guessing steps: one graph per batch-size bucket runs all k
steps, each one token per request, so a proposal is one replay.

Guessing k tokens is k passes of one token per request, each as small as a decode step and
dependent on the last; launched from Python, their kernels cost more than they compute (an
EAGLE-3 head's four steps took 7.8 ms eagerly on an H100, a fraction of it on the GPU). The
graph of a bucket (up to the one that holds ``disable_by_batch_size`` requests: larger steps do
not speculate) chains the k steps of the proposer's ``guess`` with their argmaxes, reading
every step's positions, slots and context lengths from static buffers
(:class:`hookllm.spec.draft_kv.GuessSteps`). Padding rows write no K/V (slot -1). The graphs
share the target's graph memory pool: the engine replays one graph at a time, and each keeps
only its static outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hookllm.spec.draft_kv import GuessSteps
from hookllm.worker.cuda_graph import CudaGraphRunner

if TYPE_CHECKING:
    from hookllm.spec.proposer import ModelProposer


class GuessGraphs:
    """``proposer.guess`` chained ``num_steps`` times, captured for each of ``batch_buckets``
    (those of ``target`` where steps speculate), with ``target``'s block-table width, context
    limit, backend and memory pool."""

    def __init__(self, proposer: ModelProposer, num_steps: int, target: CudaGraphRunner, batch_buckets: list[int]):
        self.proposer = proposer
        self.num_steps = num_steps
        self.buckets = batch_buckets
        self.max_model_len = target.max_model_len
        self.backend = target.backend
        groups, batch, max_blocks = target.block_tables.shape
        device = target.block_tables.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        state = proposer.guess_state(batch)  # e.g. an EAGLE head's features; None for a draft model
        self.state = state.zero_() if state is not None else None
        self.positions = torch.zeros(num_steps, batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((num_steps, groups, batch), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(groups, batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(num_steps, batch, dtype=torch.int32, device=device)
        self.guesses = torch.zeros(batch, num_steps, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all(target.pool)

    @torch.inference_mode()
    def _capture_all(self, pool) -> None:
        for bs in reversed(self.buckets):  # largest first, as the target's
            self._guess_all(bs)  # warm-up: compile and autotune
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._guess_all(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _guess_all(self, bs: int) -> None:
        steps = GuessSteps(self.positions[:, :bs], self.slot_mapping[:, :, :bs], self.block_tables[:, :bs],
                           self.seq_lens[:, :bs], [self.max_model_len] * self.num_steps, self.backend)
        state = self.state[:bs] if self.state is not None else None
        self.guesses[:bs] = self.proposer.guess_eagerly(self.tokens[:bs], state, steps)

    def can_run(self, steps: GuessSteps) -> bool:
        return (steps.num_steps == self.num_steps and steps.positions.shape[1] <= self.buckets[-1]
                and steps.block_tables.shape[2] <= self.block_tables.shape[2])

    def run(self, tokens: torch.Tensor, state: torch.Tensor | None, steps: GuessSteps) -> torch.Tensor:
        """``[requests, num_steps]`` guesses from each request's ``tokens`` (and ``state``),
        through its bucket's graph (``can_run`` said yes)."""
        n, width = tokens.shape[0], steps.block_tables.shape[2]
        padded = next(b for b in self.buckets if b >= n)
        self.tokens[:n] = tokens
        if state is not None:
            self.state[:n] = state
        self.positions[:, :n] = steps.positions
        self.slot_mapping[:, :, :n] = steps.slot_mapping
        self.slot_mapping[:, :, n:padded] = -1
        self.block_tables[:, :n, :width] = steps.block_tables
        self.seq_lens[:, :n] = steps.seq_lens
        self.seq_lens[:, n:padded] = 1
        self.graphs[padded].replay()
        return self.guesses[:n]
