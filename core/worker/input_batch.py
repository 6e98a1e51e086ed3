"""The runner's persistent batch: each running request keeps a row of host arrays and device
tensors across steps, and a step applies only what changed.

A request takes a row the first time the runner runs it (new, or back after a preemption) and
gives it back when it finishes or is preempted. Its row holds what a step would otherwise
rebuild from Python objects: each KV cache group's block table, on the host (the slot mapping is
computed there) and on the device (the attention kernels read it), its sampler parameters, and
its LoRA adapter's id (``lora_int_id``, -1 for none; the LoRA manager maps ids to slots) and,
under speculative decoding, its token ids so far (what a proposer searches, kept up to date
with the tokens each step adds instead of rebuilt from the request's list every step).
The scheduler sends only the block ids a table lacks (``SchedulerOutput.block_updates``: a new
block every ``block_size`` tokens in a decode step), written to both copies; a step's block
tables and sampler table are then gathers by row, on the device and the host.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from hookllm.worker.batch import CachedRequestState

# A row's sampler parameters: temperature, top_k, top_p, min_p, seeded (CachedRequestState.sampler_row).
SAMPLER_FIELDS = 5


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class InputBatch:
    def __init__(self, num_groups: int, device: torch.device, num_rows: int = 16, num_columns: int = 64,
                 keeps_token_ids: bool = False):
        self.device = device
        self.keeps_token_ids = keeps_token_ids
        self.token_ids = np.zeros((0, 0), dtype=np.int64)  # [rows, tokens] when keeps_token_ids
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []
        self.block_table = np.zeros((num_groups, 0, 0), dtype=np.int32)  # [groups, rows, columns]
        self.num_blocks = np.zeros(0, dtype=np.int64)  # each row's table width
        self.sampler_table = np.zeros((SAMPLER_FIELDS, 0), dtype=np.float32)
        self.lora_ids = np.zeros(0, dtype=np.int64)  # each row's adapter id, -1: the base model
        self.device_block_table = torch.zeros(self.block_table.shape, dtype=torch.int32, device=device)
        self._grow(num_rows, num_columns)

    def rows(self, request_ids: Sequence[str], states: Mapping[str, CachedRequestState]) -> np.ndarray:
        """Each request's row (int64), taking rows for those that hold none yet (``states``: the
        runner's requests, for their sampler parameters)."""
        try:
            return np.fromiter(map(self.row_of.__getitem__, request_ids), dtype=np.int64, count=len(request_ids))
        except KeyError:
            for request_id in request_ids:
                if request_id not in self.row_of:
                    self._add(states[request_id])
            return self.rows(request_ids, states)

    def remove(self, request_id: str) -> None:
        """Give the request's row back (unknown ids pass: a request preempted before it ran)."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self.num_tokens[row] = 0
            self.free_rows.append(row)

    def write_token_ids(self, rows: np.ndarray, starts: np.ndarray, token_ids: Sequence[Sequence[int]]) -> None:
        """Write each row's ``token_ids`` from its ``starts`` (a request's tokens as they come:
        the scheduler's new ones, a step's emitted ones; one fancy-indexed write for all)."""
        lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
        if not lengths.any():
            return
        ends = starts + lengths
        if ends.max() > self.token_ids.shape[1]:
            grown = np.zeros((self.token_ids.shape[0], _round_up(int(ends.max()) * 2, 256)), dtype=np.int64)
            grown[:, :self.token_ids.shape[1]] = self.token_ids
            self.token_ids = grown
        entry_rows = np.repeat(rows, lengths)
        columns = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(lengths) - lengths),
                                                                          lengths)
        self.token_ids[entry_rows, columns] = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64,
                                                          count=len(columns))
        np.maximum.at(self.num_tokens, rows, ends)

    def token_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' token ids ``[len(rows), longest]`` (padding after each one's length) and lengths."""
        lengths = self.num_tokens[rows]
        return self.token_ids[rows, :int(lengths.max(initial=0))], lengths

    def update_block_tables(self, rows: np.ndarray, updates: Sequence[tuple[int, int, np.ndarray]]) -> np.ndarray:
        """Write a step's block updates (``SchedulerOutput.block_updates``, indexed like ``rows``)
        into the host tables; returns what the device tables need, ``[2, n]`` int64 (flat
        indices, then block ids), for the caller to copy with the step's other inputs and hand to
        :meth:`apply_device_updates`. One set of array operations, whatever the number of updates."""
        if not updates:
            return np.zeros((2, 0), dtype=np.int64)
        indices, firsts, block_ids = zip(*updates)
        lengths = np.fromiter((ids.shape[1] for ids in block_ids), dtype=np.int64, count=len(updates))
        firsts = np.asarray(firsts, dtype=np.int64)
        update_rows = rows[np.asarray(indices, dtype=np.int64)]
        ends = firsts + lengths
        if ends.max() > self.block_table.shape[2]:
            self._grow(self.block_table.shape[1], int(ends.max()))
        # Every updated entry's row and column, laid out flat as the ids are.
        total = int(lengths.sum())
        entry_rows = np.repeat(update_rows, lengths)
        columns = np.arange(total, dtype=np.int64) + np.repeat(firsts - (np.cumsum(lengths) - lengths), lengths)
        values = np.concatenate(block_ids, axis=1)  # [groups, total]
        self.block_table[:, entry_rows, columns] = values
        self.num_blocks[update_rows] = ends
        groups, num_rows, num_columns = self.block_table.shape
        flat_index = (np.arange(groups, dtype=np.int64)[:, None] * (num_rows * num_columns)
                      + entry_rows * num_columns + columns)
        return np.stack([flat_index.ravel(), values.ravel().astype(np.int64)])

    def apply_device_updates(self, updates: torch.Tensor) -> None:
        """Write ``update_block_tables``' result, now on the device, into the device tables."""
        if updates.shape[1]:
            self.device_block_table.view(-1)[updates[0]] = updates[1].to(torch.int32)

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """Every group's flat cache slot of each position in the matching row's blocks (``rows``
        and ``positions`` broadcast together): ``[groups, *their shape]``."""
        return self.block_table[:, rows, positions // block_size] * block_size + positions % block_size

    def device_block_tables(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[groups, len(rows), width]`` int32 on the device: the rows' block tables (``rows`` on
        the device). The gathered planes are 16-byte aligned (the width is padded to 4 columns):
        Triton compiles a kernel variant per pointer alignment."""
        return self.device_block_table[:, rows, :_round_up(width, 4)][:, :, :width]

    def _add(self, request: CachedRequestState) -> None:
        if not self.free_rows:
            self._grow(2 * self.block_table.shape[1], self.block_table.shape[2])
        row = self.free_rows.pop()
        self.row_of[request.request_id] = row
        self.sampler_table[:, row] = request.sampler_row
        self.lora_ids[row] = -1 if request.lora_request is None else request.lora_request.lora_int_id
        if self.keeps_token_ids:
            self.write_token_ids(np.array([row]), np.zeros(1, dtype=np.int64), [request.all_token_ids])

    def _grow(self, num_rows: int, num_columns: int) -> None:
        """Grow the rows to ``num_rows`` and the columns to hold ``num_columns`` (rarely: the
        runner sizes them for its engine), keeping every entry on the host and the device."""
        groups, old_rows, old_columns = self.block_table.shape
        num_columns = _round_up(max(num_columns, old_columns), 64)
        table = np.zeros((groups, num_rows, num_columns), dtype=np.int32)
        table[:, :old_rows, :old_columns] = self.block_table
        self.block_table = table
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(num_rows - old_rows, dtype=np.int64)])
        self.sampler_table = np.concatenate(
            [self.sampler_table, np.zeros((SAMPLER_FIELDS, num_rows - old_rows), dtype=np.float32)], axis=1)
        self.lora_ids = np.concatenate([self.lora_ids, np.full(num_rows - old_rows, -1, dtype=np.int64)])
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros(num_rows - old_rows, dtype=np.int64)])
        self.token_ids = np.concatenate(
            [self.token_ids, np.zeros((num_rows - old_rows, self.token_ids.shape[1]), dtype=np.int64)])
        self.free_rows = list(range(num_rows - 1, old_rows - 1, -1)) + self.free_rows
        device_table = torch.zeros(table.shape, dtype=torch.int32, device=self.device)
        device_table[:, :old_rows, :old_columns] = self.device_block_table
        self.device_block_table = device_table
