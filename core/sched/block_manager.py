"""The paged KV cache's bookkeeping: which fixed-size blocks each request holds.

Blocks are reference counted, so requests can share them: a prefix-cache hit or a fork
(beam search) adds a reference instead of a copy. A full block whose tokens are computed gets
a SHA-256 content hash (of its parent block's hash, its token ids, the content hashes of the
images whose placeholder rows fall in it, and the request's ``cache_salt``); freed, it stays
findable by that hash until it is reused, least recently freed first. Only a block held by one
request is ever written: a request about to write into a block it shares (the partial last block
of a fork) gets a private copy first (copy-on-write), which the worker makes before the step's
forward.

With a sliding window of W tokens in every layer (``sliding_window``), a query at position p
reads keys p - W + 1 .. p only, so a sequence's blocks wholly before its next query's window
are freed as it advances: its block table keeps them as the null block (block 0, reserved,
never written), which the kernels never read. Such a request holds at most a chunk's blocks
plus the W - 1 tokens before it (``peak_blocks``).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hookllm.sched.request import Request


def _string(text: str) -> bytes:
    """UTF-8 behind its byte length, so where a string ends is never ambiguous."""
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _root_hash(cache_salt: str | None) -> bytes:
    """What a request's first block chains from: requests with different salts share no block."""
    return hashlib.sha256(b"\x00" if cache_salt is None else b"\x01" + _string(cache_salt)).digest()


def _block_hash(parent: bytes, token_ids: Sequence[int], images: list[tuple[str, int]]) -> bytes:
    # Fixed-width, count-prefixed fields and a kind byte no root message starts with: two different
    # blocks never encode alike, so equal digests mean equal content short of a SHA-256 collision.
    n = len(token_ids)
    message = b"\x02" + parent + struct.pack(f"<Q{n}qQ", n, *token_ids, len(images))
    for content_hash, offset in images:
        message += _string(content_hash) + struct.pack("<q", offset)
    return hashlib.sha256(message).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None  # set while the block is findable in the prefix cache


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        # With a window, the entries of blocks before it point at block 0, kept out of the free
        # list; without one, no entry is null and block 0 is an ordinary block.
        self.null_block = 0 if sliding_window is not None else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks no request holds, least recently freed first: a cached one among them is evicted
        # (loses its hash) only when it is taken for new tokens.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(0 if self.null_block is None else 1, num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # (source, destination) block pairs the worker must copy before the next step runs.
        self.pending_copies: list[tuple[int, int]] = []
        # Each request holding blocks owns a row mirroring its block_ids, so a step's block
        # tables are one numpy gather instead of being rebuilt from Python lists.
        self.table = np.zeros((0, 0), dtype=np.int32)
        self.free_rows: list[int] = []

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block is not one)."""
        return len(self.blocks) - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted on demand)."""
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a request of up to ``num_tokens`` tokens holds at once when a step
        computes at most ``max_chunk_tokens`` of it: every block without a window; with one, those
        under a chunk and the W - 1 tokens before it, however they straddle block boundaries."""
        blocks = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return blocks
        live_tokens = self.sliding_window - 1 + min(max_chunk_tokens, num_tokens)
        return min(blocks, self.blocks_needed(live_tokens + self.block_size - 1))

    def blocks_to_fit(self, requests: list[Request], max_chunk_tokens: int) -> int:
        """The most blocks the completions of one user request (one, or ``n`` sharing a prompt)
        hold together: if the cache has fewer, they could never all run."""
        first = requests[0]
        # Under prefix caching the children share the prompt's full blocks (all of them: an upper bound).
        shared = (first.num_prompt_tokens // self.block_size
                  if len(requests) > 1 and self.enable_prefix_caching else 0)
        whole = shared + sum(self.blocks_needed(r.max_num_tokens) - shared for r in requests)
        return min(whole, sum(self.peak_blocks(r.max_num_tokens, max_chunk_tokens) for r in requests))

    def _window_start(self, position: int) -> int:
        """The first block a query at ``position`` (or later) may read: 0 without a window."""
        if self.sliding_window is None:
            return 0
        return max(0, (position - self.sliding_window + 1) // self.block_size)

    def _live(self, block_ids: Sequence[int]) -> list[int]:
        return [block_id for block_id in block_ids if block_id != self.null_block]

    def live_block_ids(self, request: Request) -> list[int]:
        """The blocks the request holds, in order (its block-table entries that are not null)."""
        return self._live(request.block_ids)

    # -- prefix cache -------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The SHA-256 digests of the request's first ``num_blocks`` full blocks (extended lazily).

        Block i's digest is sha256 of: byte 0x02, block i-1's digest (for block 0, the root:
        sha256 of byte 0x00 without a cache salt, or of byte 0x01 and the salt), the token count
        and the token ids, the count of images whose placeholder rows overlap the block, and for
        each, in ``mm_items`` order, its ``content_hash`` and its offset from the block's start
        (negative if it began in an earlier block). Integers are little-endian 8-byte (counts
        unsigned, token ids and offsets signed); a string is its UTF-8 byte length, then the bytes.
        """
        hashes, size = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            start, end = i * size, (i + 1) * size
            # Image rows share one placeholder id: the image's content hash tells them apart.
            images = [(item.content_hash, item.offset - start) for item in request.mm_items
                      if item.offset < end and item.offset + item.length > start]
            parent = hashes[-1] if hashes else _root_hash(request.cache_salt)
            hashes.append(_block_hash(parent, tokens[start:end], images))
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids standing for the longest run of the request's full blocks it need not compute.

        Without a window: the longest cached run from its start. With one: the longest run
        whose blocks a query right after it reads (the last ceil((W - 1) / block_size)) are all
        cached; the entries before those are the null block. A block's hash chains every token
        before it, so a cached block holds this request's K/V whatever happened to its
        predecessors. The last known token is never covered, so the request still computes a
        row to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        found = [self.cached.get(block_hash) for block_hash in
                 self.block_hashes(request, (len(request.all_token_ids) - 1) // self.block_size)]
        longest, run = 0, 0  # run: cached blocks in a row up to the current one
        for end, block_id in enumerate(found, 1):
            run = run + 1 if block_id is not None else 0
            if run >= end - self._window_start(end * self.block_size):
                longest = end
        first = self._window_start(longest * self.block_size)
        return [self.null_block] * first + found[first:longest]

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the request's blocks full of its first ``num_tokens`` (known) tokens findable."""
        full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        if full <= request.num_registered_blocks:
            return
        for i, block_hash in enumerate(self.block_hashes(request, full)[request.num_registered_blocks:],
                                       request.num_registered_blocks):
            if request.block_ids[i] == self.null_block:
                continue  # out of its window (a request resumed from swap holds none there): not held
            block = self.blocks[request.block_ids[i]]
            # Another request may have computed the same content first: its block stays the cached one.
            if block.hash is None and block_hash not in self.cached:
                block.hash = block_hash
                self.cached[block_hash] = block.block_id
        request.num_registered_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (benchmarks compare cold runs); only while no request holds blocks."""
        if len(self.free_block_ids) != self.num_blocks:
            raise RuntimeError("reset_prefix_cache needs every block free")
        for block_id in self.cached.values():
            self.blocks[block_id].hash = None
        self.cached.clear()

    # -- allocation ---------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow ``request.block_ids`` to hold its computed tokens, ``cached_blocks`` (a prefix-cache
        hit from :meth:`find_cached_prefix`, taken first, whose tokens the caller then counts as
        computed) and ``num_new_tokens``. With a window, the blocks that fell out of the request's
        window are freed first, so they count as free here.

        Returns False when too few blocks are free, changing nothing else.
        """
        self.free_out_of_window(request)
        size = self.block_size
        end, block_ids = request.num_computed_tokens + num_new_tokens, request.block_ids
        first = request.num_computed_tokens // size
        if (num_new_tokens and not cached_blocks and end <= len(block_ids) * size and first == (end - 1) // size
                and self.blocks[block_ids[first]].ref_count == 1):
            # The usual decode step, for every running request every step: the tokens go into a
            # block the request alone holds already, so nothing is allocated, copied or rewritten.
            if self.enable_prefix_caching:
                self._register_full_blocks(request, end)
            return True
        computed = request.num_computed_tokens + len(cached_blocks) * size
        total_blocks = self.blocks_needed(computed + num_new_tokens)
        held = len(request.block_ids) + len(cached_blocks)
        # A request resumed from swap holds nothing yet: the blocks before its window stay null.
        start = max(held, self._window_start(computed))
        # Blocks this step writes that another request also holds: each needs a private copy.
        shared = [i for i in range(computed // size, min(len(request.block_ids), total_blocks))
                  if self.blocks[request.block_ids[i]].ref_count > 1]
        revived = sum(1 for block_id in self._live(cached_blocks) if self.blocks[block_id].ref_count == 0)
        if max(total_blocks - start, 0) + len(shared) + revived > len(self.free_block_ids):
            return False
        first_changed = shared[0] if shared else len(request.block_ids)
        if cached_blocks:  # only a request holding no blocks looks up the cache
            for block_id in self._live(cached_blocks):
                self._take(block_id)
            request.block_ids += cached_blocks
            request.num_registered_blocks = len(request.block_ids)
        request.block_ids += [self.null_block] * (start - held)
        for i in shared:
            source = self.blocks[request.block_ids[i]]
            source.ref_count -= 1
            copy = self._allocate_free()
            self.pending_copies.append((source.block_id, copy))
            request.block_ids[i] = copy
        for _ in range(total_blocks - len(request.block_ids)):
            request.block_ids.append(self._allocate_free())
        self._write_row(request, first_changed)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, computed + num_new_tokens)
        return True

    def free_out_of_window(self, request: Request) -> None:
        """Free the request's blocks that no query from its next position on reads (wholly
        before that query's window); their entries become the null block.

        Under async scheduling the step still on the device may read them: another request can
        take them in the next step at the earliest, whose work the device runs after it (freeing
        a finished request's blocks at once relies on the same order).
        """
        if self.sliding_window is None:
            return
        block_ids = request.block_ids
        end = min(self._window_start(request.num_computed_tokens), len(block_ids))
        i = end - 1
        # Freed entries are a prefix: walk back from the window to the last one freed before.
        while i >= 0 and block_ids[i] != self.null_block:
            self._release(block_ids[i])
            block_ids[i] = self.null_block
            i -= 1
        if i < end - 1:
            self.table[request.block_table_row, i + 1:end] = self.null_block

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share every block ``parent`` holds (it continues the parent's tokens)."""
        for block_id in self.live_block_ids(parent):
            self.blocks[block_id].ref_count += 1
        child.block_ids = list(parent.block_ids)
        child.num_registered_blocks = parent.num_registered_blocks
        self._write_row(child, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _take(self, block_id: int) -> None:
        """Add a reference to a cached block (taking it off the free list if nobody held it)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        """Drop one reference to a block; unreferenced, it goes to the free list (still findable)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def _allocate_free(self) -> int:
        """A free block for new tokens, least recently freed first, evicted from the cache."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def _write_row(self, request: Request, first: int) -> None:
        if request.block_table_row is None:
            request.block_table_row = self._take_row()
        self._fit_columns(len(request.block_ids))
        self.table[request.block_table_row, first:len(request.block_ids)] = request.block_ids[first:]

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
        """Drop the request's reference to each of its blocks (finished, aborted or preempted).

        Its last blocks are freed first, so they are evicted before the prefix others may share.
        """
        for block_id in reversed(self.live_block_ids(request)):
            self._release(block_id)
        request.block_ids = []
        request.num_registered_blocks = 0
        if request.block_table_row is not None:
            self.table[request.block_table_row] = 0
            self.free_rows.append(request.block_table_row)
            request.block_table_row = None


class HostBlockAllocator:
    """Which host (swap space) blocks hold the KV contents of swapped-out requests.

    Plain ids, no sharing: only a request whose device blocks are all its own is swapped.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` free host block ids, or None (taking nothing) when too few are free."""
        if num_blocks > len(self.free_block_ids):
            return None
        return [self.free_block_ids.pop() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self.free_block_ids += reversed(block_ids)
