"""The paged KV cache's bookkeeping: which fixed-size blocks each request holds.

Blocks are reference counted, so requests can share them: a prefix-cache hit or a fork
(beam search) adds a reference instead of a copy. A full block whose tokens are computed gets
a SHA-256 content hash (of its parent block's hash, its token ids, the content hashes of the
images whose placeholder rows fall in it, and the request's ``cache_salt``); freed, it stays
findable by that hash until it is reused, least recently freed first. Only a block held by one
request is ever written: a request about to write into a block it shares (the partial last block
of a fork) gets a private copy first (copy-on-write), which the worker makes before the step's
forward.

KV cache groups (``hookllm.worker.kv_cache_groups``): the model's layers are grouped by sliding
window, and a request holds one block table per group (``block_ids(request)[group]``, a row of
the manager's ``table``, the one place block ids are kept), all the same length, one entry per ``block_size`` tokens; the groups draw block ids from one pool. A
model whose layers all share one window (or have none) has one group: the manager then does
exactly what a single block table does. Prefix caching keys a block by (group, hash): the same
tokens have one hash but a block per group.

In a group whose layers slide over W tokens, a query at position p reads keys p - W + 1 .. p
only, so a sequence's blocks wholly before its next query's window are freed as it advances:
that group's table keeps them as the null block (block 0, reserved, never written), which the
kernels never read. There a request holds at most a chunk's blocks plus the W - 1 tokens
before it, while a full-attention group holds every block (``peak_blocks`` sums the groups).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from hookllm.sched.kv_events import AllBlocksCleared, KVCacheEvent, block_removed, block_stored
from hookllm.sched.request import Request


def _string(text: str) -> bytes:
    """UTF-8 behind its byte length, so where a string ends is never ambiguous."""
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _root_hash(cache_salt: str | None, lora_int_id: int | None = None) -> bytes:
    """What a request's first block chains from: requests with different salts, or different
    LoRA adapters (whose K/V differ for the same tokens), share no block."""
    message = b"\x00" if cache_salt is None else b"\x01" + _string(cache_salt)
    if lora_int_id is not None:
        message += b"\x03" + struct.pack("<q", lora_int_id)
    return hashlib.sha256(message).digest()


def _block_hash(parent: bytes, token_ids: Sequence[int], images: list[tuple[str, int]]) -> bytes:
    # Fixed-width, count-prefixed fields and a kind byte no root message starts with: two different
    # blocks never encode alike, so equal digests mean equal content short of a SHA-256 collision.
    n = len(token_ids)
    message = b"\x02" + parent + struct.pack(f"<Q{n}qQ", n, *token_ids, len(images))
    for content_hash, offset in images:
        message += _string(content_hash) + struct.pack("<q", offset)
    return hashlib.sha256(message).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "cache_key")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        # (group, content hash) while the block is findable in the prefix cache.
        self.cache_key: tuple[int, bytes] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 group_windows: Sequence[int | None] = (None,)):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Each KV cache group's sliding window in tokens, None for full attention: a request holds
        # one block table per group.
        self.group_windows = tuple(group_windows)
        # Each sliding window and its groups (a model's sliding layers may fill several).
        self.window_groups = [(window, [group for group, own in enumerate(self.group_windows) if own == window])
                              for window in dict.fromkeys(self.group_windows) if window is not None]
        # With a window, the entries of blocks before it point at block 0, kept out of the free
        # list; without one, no entry is null and block 0 is an ordinary block.
        self.null_block = 0 if self.window_groups else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks no request holds. Under prefix caching, least recently freed first: a cached one
        # among them is evicted (loses its hash) only when it is taken for new tokens. Without it
        # a freed block holds nothing findable, so a stack serves (taken and given back by slices,
        # not a dict operation per block: a prompt takes a block per block_size tokens).
        first = 0 if self.null_block is None else 1
        self.free_block_ids: OrderedDict[int, None] | list[int] = (
            OrderedDict.fromkeys(range(first, num_blocks)) if enable_prefix_caching
            else list(range(num_blocks - 1, first - 1, -1)))
        self.cached: dict[tuple[int, bytes], int] = {}  # (group, block hash) -> block id
        # (source, destination) block pairs the worker must copy before the next step runs.
        self.pending_copies: list[tuple[int, int]] = []
        # KV-cache events (hookllm.sched.kv_events): None unless the engine publishes them; then
        # blocks entering and leaving the prefix cache are recorded here until take_kv_events.
        # Disabled, the cost is one test per block cached or evicted.
        self.kv_events: list[KVCacheEvent] | None = None
        # The scheduler's store of block ids: each request holding blocks owns a row
        # (request.block_table_row) in every group's plane, its first row_widths[row] entries in use.
        self._set_table(np.zeros((len(self.group_windows), 0, 0), dtype=np.int32))
        self.row_widths: list[int] = []
        # Per row, how many leading entries the model runner holds as they are: a step sends it
        # only the entries from there on (take_block_updates), not whole tables.
        self.row_synced: list[int] = []
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

    def _group_peak(self, window: int | None, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks one group's table of a request of up to ``num_tokens`` tokens holds at
        once when a step computes at most ``max_chunk_tokens`` of it: every block without a
        window; with one, those under a chunk and the W - 1 tokens before it, however they
        straddle block boundaries."""
        blocks = self.blocks_needed(num_tokens)
        if window is None:
            return blocks
        live_tokens = window - 1 + min(max_chunk_tokens, num_tokens)
        return min(blocks, self.blocks_needed(live_tokens + self.block_size - 1))

    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a request of up to ``num_tokens`` tokens holds at once, over every group."""
        return sum(self._group_peak(window, num_tokens, max_chunk_tokens) for window in self.group_windows)

    def blocks_to_fit(self, requests: list[Request], max_chunk_tokens: int) -> int:
        """The most blocks the completions of one user request (one, or ``n`` sharing a prompt)
        hold together: if the cache has fewer, they could never all run."""
        first = requests[0]
        if len(requests) == 1 and not self.window_groups:  # the usual case, once per request: every group whole
            return len(self.group_windows) * self.blocks_needed(first.max_num_tokens)
        # Under prefix caching the children share the prompt's full blocks (all of them: an upper bound).
        shared = (first.num_prompt_tokens // self.block_size
                  if len(requests) > 1 and self.enable_prefix_caching else 0)
        whole = shared + sum(self.blocks_needed(r.max_num_tokens) - shared for r in requests)
        return sum(min(whole, sum(self._group_peak(window, r.max_num_tokens, max_chunk_tokens) for r in requests))
                   for window in self.group_windows)

    def _window_start(self, window: int | None, position: int) -> int:
        """The first block a query at ``position`` (or later) may read in a group sliding over
        ``window`` tokens: 0 without a window."""
        if window is None:
            return 0
        return max(0, (position - window + 1) // self.block_size)

    def _live(self, block_ids: Sequence[int]) -> list[int]:
        return [block_id for block_id in block_ids if block_id != self.null_block]

    def holds_blocks(self, request: Request) -> bool:
        """Whether the request has block tables (it may hold blocks now)."""
        return request.block_table_row is not None

    def block_ids(self, request: Request) -> list[list[int]]:
        """Per KV cache group, the request's block table: one block per ``block_size`` tokens (in
        a sliding group, those before its window are the null block); empty while it holds none."""
        row = request.block_table_row
        return [] if row is None else self.table[:, row, :self.row_widths[row]].tolist()

    def live_block_ids(self, request: Request) -> list[list[int]]:
        """Per group, the blocks the request holds, in order (its table's entries that are not
        null); empty while it holds none."""
        return [self._live(block_ids) for block_ids in self.block_ids(request)]

    # -- prefix cache -------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The SHA-256 digests of the request's first ``num_blocks`` full blocks (extended lazily).

        Block i's digest is sha256 of: byte 0x02, block i-1's digest (for block 0, the root:
        sha256 of byte 0x00 without a cache salt, or of byte 0x01 and the salt; then, for a request
        with a LoRA adapter, byte 0x03 and its ``lora_int_id``), the token count
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
            parent = hashes[-1] if hashes else _root_hash(
                request.cache_salt, None if request.lora_request is None else request.lora_request.lora_int_id)
            hashes.append(_block_hash(parent, tokens[start:end], images))
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> list[tuple[int, ...]]:
        """The longest run of the request's full blocks it need not compute: for each of those
        blocks, its id in every group (the null block where a group's window has left it).

        A run of n blocks is usable in a group when the blocks a query right after it reads are
        all cached there: every block without a window; with one, the last ceil((W - 1) /
        block_size), the entries before those being the null block. The run taken is the
        longest usable in every group. A block's hash chains every token before it, so a cached
        block holds this request's K/V whatever happened to its predecessors. The last known
        token is never covered, so the request still computes a row to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self.block_hashes(request, (len(request.all_token_ids) - 1) // self.block_size)
        found, usable = [], []
        limit = len(hashes)  # no run is longer than the longest usable in a group already seen
        # Full-attention groups come first (hookllm.worker.kv_cache_groups): their usable runs are
        # the prefixes up to the first miss, so later groups look up no further.
        for group, window in enumerate(self.group_windows):
            ids = [self.cached.get((group, block_hash)) for block_hash in hashes[:limit]]
            found.append(ids)
            usable.append(self._usable_runs(ids, window))
            limit = max(end for end, ok in enumerate(usable[-1]) if ok)
        longest = max(end for end in range(limit + 1) if all(ok[end] for ok in usable))
        columns = []
        for ids, window in zip(found, self.group_windows):
            first = self._window_start(window, longest * self.block_size)
            columns.append([self.null_block] * first + ids[first:longest])
        return list(zip(*columns))

    def _usable_runs(self, found: list[int | None], window: int | None) -> list[bool]:
        """For each run length n (0 .. len(found)): whether a query right after the first n
        blocks finds every block it reads in ``found`` (a group's cached ids, None if missing)."""
        usable, run = [True], 0  # run: cached blocks in a row up to the current one
        for end, block_id in enumerate(found, 1):
            run = run + 1 if block_id is not None else 0
            usable.append(run >= end - self._window_start(window, end * self.block_size))
        return usable

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the request's blocks full of its first ``num_tokens`` (known) tokens findable."""
        full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        registered = request.num_registered_blocks
        if full <= registered:
            return
        hashes = self.block_hashes(request, full)
        columns = self.table[:, request.block_table_row, registered:full].tolist()
        for group, block_ids in enumerate(columns):
            for index, (block_id, block_hash) in enumerate(zip(block_ids, hashes[registered:]), registered):
                if block_id == self.null_block:
                    continue  # out of its window (a request resumed from swap holds none there): not held
                block, key = self.blocks[block_id], (group, block_hash)
                # Another request may have computed the same content first: its block stays the cached one.
                if block.cache_key is None and key not in self.cached:
                    block.cache_key = key
                    self.cached[key] = block_id
                    if self.kv_events is not None:
                        tokens = request.all_token_ids[index * self.block_size:(index + 1) * self.block_size]
                        parent = hashes[index - 1] if index else None
                        self.kv_events.append(block_stored(block_hash, parent, tokens, self.block_size, group,
                                                                request.lora_request))
        request.num_registered_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (benchmarks compare cold runs); only while no request holds blocks."""
        if len(self.free_block_ids) != self.num_blocks:
            raise RuntimeError("reset_prefix_cache needs every block free")
        for block_id in self.cached.values():
            self.blocks[block_id].cache_key = None
        self.cached.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (events must be enabled)."""
        events, self.kv_events = self.kv_events, []
        return events

    # -- allocation ---------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[tuple[int, ...]] = (), num_lookahead_tokens: int = 0) -> bool:
        """Grow every group's block table of the request to hold its computed tokens, ``cached_blocks``
        (a prefix-cache hit from :meth:`find_cached_prefix`, taken first, whose tokens the caller
        then counts as computed), ``num_new_tokens`` and ``num_lookahead_tokens`` more (where a
        draft model writes its guesses' K/V after the step). In a sliding group, the blocks that
        fell out of the request's window are freed first, so they count as free here.

        Returns False when too few blocks are free, changing nothing else.
        """
        if self.window_groups:
            self.free_out_of_window(request)
        size = self.block_size
        row = request.block_table_row
        holding = 0 if row is None else self.row_widths[row]
        end, first = request.num_computed_tokens + num_new_tokens, request.num_computed_tokens // size
        # A block a request writes next is shared only after a fork, which shares every group's
        # block there alike (and the copy-on-write below copies them all): group 0's tells for all.
        if (num_new_tokens and end + num_lookahead_tokens <= holding * size and first == (end - 1) // size
                and self.blocks[self._entries[0, row, first]].ref_count == 1):
            # The usual decode step, for every running request every step: the tokens go into
            # blocks the request alone holds already, so nothing is allocated, copied or rewritten;
            # a block it fills becomes findable (the test spares a call for every other token).
            if self.enable_prefix_caching and end // size > request.num_registered_blocks:
                self._register_full_blocks(request, end)
            return True
        # A request holding no blocks gets its tables only if the allocation succeeds.
        tables = self.block_ids(request) or [[] for _ in self.group_windows]
        computed = request.num_computed_tokens + len(cached_blocks) * size
        total_blocks = self.blocks_needed(computed + num_new_tokens + num_lookahead_tokens)
        held = holding + len(cached_blocks)
        # Blocks this step writes that the request holds: those another request also holds (a
        # fork's partial last block) each need a private copy.
        rewritten = range(computed // size, min(holding, total_blocks))
        starts, shared, wanted = [], [], 0
        for window, block_ids in zip(self.group_windows, tables):
            # A request resumed from swap holds nothing yet: the blocks before a window stay null.
            start = max(held, self._window_start(window, computed))
            copies = [i for i in rewritten if self.blocks[block_ids[i]].ref_count > 1] if rewritten else []
            starts.append(start)
            shared.append(copies)
            wanted += max(total_blocks - start, 0) + len(copies)
        cached_columns = list(zip(*cached_blocks))  # per group (only a request holding no blocks has a hit)
        if cached_blocks:  # cached blocks nobody holds leave the free list
            wanted += sum(1 for column in cached_columns for block_id in self._live(column)
                          if self.blocks[block_id].ref_count == 0)
        if wanted > len(self.free_block_ids):
            return False
        if cached_blocks:
            for column in cached_columns:
                for block_id in self._live(column):
                    self._take(block_id)
            request.num_registered_blocks = held
        first_changed = holding
        for group, block_ids in enumerate(tables):
            if cached_blocks:
                block_ids += cached_columns[group]
            block_ids += [self.null_block] * (starts[group] - held)
            for i in shared[group]:
                first_changed = min(first_changed, i)
                source = self.blocks[block_ids[i]]
                source.ref_count -= 1
                copy, = self._allocate_free(1)
                self.pending_copies.append((source.block_id, copy))
                block_ids[i] = copy
            block_ids += self._allocate_free(total_blocks - len(block_ids))
        self._write_row(request, tables, first_changed)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, computed + num_new_tokens)
        return True

    def free_out_of_window(self, request: Request) -> None:
        """In each sliding group, free the request's blocks that no query from its next position
        on reads (wholly before that query's window); their entries become the null block.

        Under async scheduling the step still on the device may read them: another request can
        take them in the next step at the earliest, whose work the device runs after it (freeing
        a finished request's blocks at once relies on the same order).
        """
        row = request.block_table_row
        held = 0 if row is None else self.row_widths[row]
        for window, groups in self.window_groups:
            end = min(self._window_start(window, request.num_computed_tokens), held)
            # Groups of one window free alike, so their null entries are the same: the first
            # group tells whether any has a block to free (usually none: the window has not moved on).
            if end == 0 or self._entries[groups[0], row, end - 1] == self.null_block:
                continue
            for group in groups:
                block_ids = self.table[group, row, :end].tolist()
                i = end - 1
                # Freed entries are a prefix: walk back from the window to the last one freed before.
                while i >= 0 and block_ids[i] != self.null_block:
                    i -= 1
                self._release(block_ids[i + 1:end][::-1])
                self.table[group, row, i + 1:end] = self.null_block
                self.row_synced[row] = min(self.row_synced[row], i + 1)

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share every block ``parent`` holds (it continues the parent's tokens)."""
        tables = self.block_ids(parent)
        for block_ids in tables:
            for block_id in self._live(block_ids):
                self.blocks[block_id].ref_count += 1
        child.num_registered_blocks = parent.num_registered_blocks
        self._write_row(child, tables, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _take(self, block_id: int) -> None:
        """Add a reference to a cached block (taking it off the free list if nobody held it)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, in order; the unreferenced go to the free list (still findable)."""
        blocks, freed = self.blocks, []
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_count -= 1
            if not block.ref_count:
                freed.append(block_id)
        if self.enable_prefix_caching:
            self.free_block_ids.update(dict.fromkeys(freed))
        else:
            self.free_block_ids += freed

    def _allocate_free(self, count: int) -> list[int]:
        """``count`` free blocks for new tokens (under prefix caching the least recently freed,
        evicted from the cache)."""
        free, blocks = self.free_block_ids, self.blocks
        if not self.enable_prefix_caching:
            block_ids = free[len(free) - count:][::-1]  # the stack's top first: a fresh cache hands out 0, 1, 2...
            del free[len(free) - count:]
            for block_id in block_ids:
                blocks[block_id].ref_count = 1
            return block_ids
        block_ids = [free.popitem(last=False)[0] for _ in range(count)]
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_count = 1
            if block.cache_key is not None:
                if self.kv_events is not None:
                    self.kv_events.append(block_removed(block.cache_key[1], block.cache_key[0]))
                del self.cached[block.cache_key]
                block.cache_key = None
        return block_ids

    def _write_row(self, request: Request, tables: list[list[int]], first: int) -> None:
        """Store every group's block ids (``tables``, all one length) from ``first`` on in the
        request's table row, taking a row if it has none."""
        if request.block_table_row is None:
            request.block_table_row = self._take_row()
        row, width = request.block_table_row, len(tables[0])
        self._fit_columns(width)
        self.row_widths[row] = width
        self.row_synced[row] = min(self.row_synced[row], first)
        for group, block_ids in enumerate(tables):
            self.table[group, row, first:width] = block_ids[first:]

    def take_block_updates(self, requests: list[Request]) -> list[tuple[int, int, np.ndarray]]:
        """What the model runner lacks of these requests' tables, as ``(index in requests, first
        column, [num groups, n] block ids)``: the entries from the first one the runner does not
        hold as it is (0: the whole table, for a request new to it, resumed or forked) to the
        table's end. The usual decode step sends a row only when it took a new block. The runner
        holds them from now on."""
        updates = []
        widths, synced = self.row_widths, self.row_synced
        for index, request in enumerate(requests):
            row = request.block_table_row
            first = synced[row]
            if first < widths[row]:
                updates.append((index, first, self.table[:, row, first:widths[row]].copy()))
                synced[row] = widths[row]
        return updates

    def _set_table(self, table: np.ndarray) -> None:
        self.table = table
        # Reads one entry as a Python int at half numpy's cost (the decode step reads one per request).
        self._entries = memoryview(table)

    def _take_row(self) -> int:
        if not self.free_rows:
            groups, rows, columns = self.table.shape
            grown = np.zeros((groups, rows + max(rows, 16), columns), dtype=np.int32)
            grown[:, :rows] = self.table
            self._set_table(grown)
            self.row_widths += [0] * (grown.shape[1] - rows)
            self.row_synced += [0] * (grown.shape[1] - rows)
            self.free_rows = list(range(grown.shape[1] - 1, rows - 1, -1))
        return self.free_rows.pop()

    def _fit_columns(self, width: int) -> None:
        columns = self.table.shape[2]
        if width > columns:
            self._set_table(np.pad(self.table, ((0, 0), (0, 0), (0, max(width - columns, columns, 64)))))

    def free(self, request: Request) -> None:
        """Drop the request's reference to each of its blocks (finished, aborted or preempted).

        Its last blocks are freed first (in every group), so they are evicted before the prefix
        others may share.
        """
        tables = self.block_ids(request)
        if len(tables) == 1 and self.null_block is None:
            self._release(tables[0][::-1])
        else:
            self._release([block_id for position in reversed(list(zip(*tables))) for block_id in position
                           if block_id != self.null_block])
        request.num_registered_blocks = 0
        row = request.block_table_row
        if row is not None:
            self.table[:, row] = 0
            self.row_widths[row] = 0
            self.row_synced[row] = 0
            self.free_rows.append(row)
            request.block_table_row = None


class HostBlockAllocator:
    """Which host (swap space) blocks hold the KV contents of swapped-out requests.

    Plain ids, no sharing: only a request whose device blocks are all its own is swapped. Like
    device blocks, a host block holds the K/V of one group's layers.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def allocate(self, counts: list[int]) -> list[list[int]] | None:
        """Per KV cache group, ``counts[group]`` free host block ids; None (taking nothing)
        when too few are free."""
        if sum(counts) > len(self.free_block_ids):
            return None
        return [[self.free_block_ids.pop() for _ in range(count)] for count in counts]

    def free(self, block_ids: list[list[int]]) -> None:
        """Give back host blocks, per group as :meth:`allocate` gave them."""
        for group_block_ids in block_ids:
            self.free_block_ids += reversed(group_block_ids)
