"""Attention metadata for a model proposer's own passes, in the requests' own blocks: one token
per request at the positions after its history (its guessing steps), or runs of positions of
its choosing (an EAGLE head's pass over a step's tokens, one position behind the target's).

A proposer with a model (:class:`hookllm.spec.proposer.ModelProposer`) keeps its K/V in the
target's blocks: position p of a request lives in the block its table holds for p. Guessing k
tokens writes positions ``L - 1`` to ``L + k - 2`` of a request of ``L`` tokens, past what the
target computed: the scheduler keeps ``k`` slots ahead of a speculating request's tokens for
them, and what is written there is scratch the next step writes over.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Iterator

import numpy as np
import torch

from hookllm.utils import to_device_async
from hookllm.worker.forward_context import AttentionMetadata
from hookllm.worker.input_batch import InputBatch


@dataclass
class GuessSteps:
    """Some requests' one-token guessing steps, on the device (``DraftKV.decode_steps``)."""

    positions: torch.Tensor  # [steps, requests] int64
    slot_mapping: torch.Tensor  # [steps, groups, requests] int64
    block_tables: torch.Tensor  # [groups, requests, width] int32
    seq_lens: torch.Tensor  # [steps, requests] int32
    max_seq_lens: list[int]  # per step
    backend: ModuleType

    @property
    def num_steps(self) -> int:
        return self.positions.shape[0]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, AttentionMetadata]]:
        """Each step's positions and attention metadata."""
        num = self.positions.shape[1]
        query_start_loc = torch.arange(num + 1, dtype=torch.int32, device=self.positions.device)
        block_tables = self.block_tables.unbind()
        for step in range(self.num_steps):
            yield self.positions[step], AttentionMetadata(
                slot_mapping=self.slot_mapping[step].unbind(), block_tables=block_tables,
                seq_lens=self.seq_lens[step], query_start_loc=query_start_loc, max_query_len=1,
                max_seq_len=self.max_seq_lens[step], backend=self.backend)


class DraftKV:
    """The slots of some requests (``rows`` of the persistent batch: a step's or a proposal
    batch's)."""

    def __init__(self, input_batch: InputBatch, rows: np.ndarray, block_size: int, backend: ModuleType,
                 device: torch.device):
        self.input_batch = input_batch
        self.rows = rows
        self.block_size = block_size
        self.backend = backend
        self.device = device

    def room(self, first: np.ndarray) -> np.ndarray:
        """How many positions from each request's ``first`` on its blocks hold (0: none, as for
        a request that reached its length limit)."""
        return np.maximum(self.input_batch.num_blocks[self.rows] * self.block_size - first, 0)

    def decode_steps(self, index: np.ndarray, first: np.ndarray, num_steps: int) -> GuessSteps:
        """For the requests ``index`` (each with room at ``first``), ``num_steps`` steps of one
        token each: step j at positions ``first + j`` (or a request's last position with room
        where its blocks end sooner: scratch it writes over). Built on the host for all steps at
        once, one copy to the device."""
        rows, num = self.rows[index], len(index)
        last = first + self.room(first)[index] - 1
        positions = np.minimum(first[None, :] + np.arange(num_steps)[:, None], last[None, :])  # [steps, n]
        slots = self.input_batch.slot_mapping(rows[None, :], positions, self.block_size)  # [groups, steps, n]
        parts = [positions.ravel(), slots.transpose(1, 0, 2).ravel().astype(np.int64), rows]
        flat = to_device_async(torch.from_numpy(np.concatenate(parts)), self.device)
        positions_t, slots_t, rows_t = flat.split([len(part) for part in parts])
        positions_t = positions_t.view(num_steps, num)
        width = int(self.input_batch.num_blocks[rows].max())
        return GuessSteps(positions_t, slots_t.view(num_steps, slots.shape[0], num),
                          self.input_batch.device_block_tables(rows_t, width), (positions_t + 1).to(torch.int32),
                          (positions.max(axis=1) + 1).tolist(), self.backend)

    def runs(self, index: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[torch.Tensor, AttentionMetadata]:
        """One pass over ``counts[i]`` consecutive positions from ``starts[i]`` of each request
        ``index[i]`` (all within its blocks; a count may be 0): the flat positions and the
        metadata, causal within each run and over the request's positions before it."""
        rows = self.rows[index]
        query_start = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        positions = np.arange(total, dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)
        slots = self.input_batch.slot_mapping(np.repeat(rows, counts), positions, self.block_size)  # [groups, total]
        seq_lens = starts + counts
        parts = [positions, slots.ravel().astype(np.int64), rows, query_start, seq_lens]
        flat = to_device_async(torch.from_numpy(np.concatenate(parts)), self.device)
        positions_t, slots_t, rows_t, query_start_t, seq_lens_t = flat.split([len(part) for part in parts])
        width = int(self.input_batch.num_blocks[rows].max(initial=1))
        return positions_t, AttentionMetadata(
            slot_mapping=slots_t.view(slots.shape[0], total).unbind(),
            block_tables=self.input_batch.device_block_tables(rows_t, width).unbind(),
            seq_lens=seq_lens_t.to(torch.int32), query_start_loc=query_start_t.to(torch.int32),
            max_query_len=int(counts.max(initial=0)), max_seq_len=int(seq_lens.max(initial=0)), backend=self.backend)
