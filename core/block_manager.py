"""The paged KV cache's bookkeeping: which fixed-size blocks each request owns.

Blocks carry a reference count and a content hash slot, so prefix caching can later share a
full block between requests by hashing (parent hash, token ids, ``request.mm_hashes_in``).
"""

from __future__ import annotations

from collections import deque

from hookllm.request import Request


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is full, for prefix caching


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

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
        for _ in range(needed):
            block = self.blocks[self.free_block_ids.popleft()]
            block.ref_count = 1
            request.block_ids.append(block.block_id)
        return True

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (finished, aborted or preempted)."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                block.block_hash = None
                self.free_block_ids.append(block_id)
        request.block_ids = []
