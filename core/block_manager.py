"""The paged KV cache's bookkeeping: which fixed-size blocks each request owns."""

from __future__ import annotations

from collections import deque

import numpy as np

from hookllm.request import Request


class Block:
    __slots__ = ("block_id", "ref_count")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # Each request holding blocks owns a row mirroring its block_ids, so a step's block
        # tables are one numpy gather instead of being rebuilt from Python lists.
        self.table = np.zeros((0, 0), dtype=np.int32)
        self.free_rows: list[int] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_ids`` to hold its computed tokens plus ``num_new_tokens``.

        Returns False, allocating nothing, when too few blocks are free.
        """
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if needed > len(self.free_block_ids):
            return False
        if needed <= 0:
            return True
        first = len(request.block_ids)
        for _ in range(needed):
            block = self.blocks[self.free_block_ids.popleft()]
            block.ref_count = 1
            request.block_ids.append(block.block_id)
        if request.block_table_row is None:
            request.block_table_row = self._take_row()
        self._fit_columns(len(request.block_ids))
        self.table[request.block_table_row, first:len(request.block_ids)] = request.block_ids[first:]
        return True

    def block_tables(self, requests: list[Request]) -> np.ndarray:
        """``[len(requests), max blocks among them]`` int32: each request's block ids, 0-padded."""
        width = max((len(r.block_ids) for r in requests), default=0)
        return self.table[[r.block_table_row for r in requests], :width]

    def _take_row(self) -> int:
        if not self.free_rows:
            rows = len(self.table)
            grown = np.zeros((rows + max(rows, 16), self.table.shape[1]), dtype=np.int32)
            grown[:rows] = self.table
            self.table = grown
            self.free_rows = list(range(len(self.table) - 1, rows - 1, -1))
        return self.free_rows.pop()

    def _fit_columns(self, width: int) -> None:
        if width > self.table.shape[1]:
            extra = max(width - self.table.shape[1], self.table.shape[1], 64)
            self.table = np.pad(self.table, ((0, 0), (0, extra)))

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (finished, aborted or preempted)."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        request.block_ids = []
        if request.block_table_row is not None:
            self.table[request.block_table_row] = 0
            self.free_rows.append(request.block_table_row)
            request.block_table_row = None
