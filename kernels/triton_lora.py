"""Triton kernels of multi-LoRA layers: ``lora_shrink`` and ``lora_expand``.

Same signatures and semantics as their twins in :mod:`hookllm.kernels.reference`. A batch's
tokens use up to L adapters at once (S-LoRA / Punica style): the caller groups each adapter
slot's tokens in ``token_order``, and both kernels work on tiles of ``BLOCK_M`` tokens of one slot,
gathered through it, so each tile loads its slot's A or B tile once and multiplies on the tensor
cores, whatever the mix of adapters in the batch:

* ``lora_shrink``: ``x[tokens] @ A[slot].T`` over the input columns, all of a fused layer's
  slices (``N = slices * R`` columns) in one tile, so ``x`` is read once. Decode-sized batches have
  few token tiles, so the K steps are cut into ``splits`` ranges, each program writing its float32
  partial sum to ``out[split]`` (``[P, T, N]``): no atomics, the same result every run.
* ``lora_expand``: each program sums a token tile's partials of one slice once, then walks
  ``blocks_per_program`` blocks of that slice's output columns: ``y += h @ B[slot].T``, in float32,
  rounded to ``y``'s dtype once. A fused layer's slices (q/k/v, gate/up) are one launch.

Both run inside CUDA graphs: the grids depend on the shapes only, never on the counts. A slot's
token tiles are numbered after the earlier slots' (a program finds its slot and tile from
``slot_counts``), so ``cdiv(T, BLOCK_M) + L - 1`` tile programs cover any split of the T tokens
among the slots, and those past the last tile return at once (all of them in a step without
adapters). Launch parameters come from the shapes (``shrink_config`` / ``expand_config``), not
from autotuning, which cannot run inside a graph's capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hookllm.kernels.triton_attention import _dot_dtype, num_sms

__all__ = ["ExpandConfig", "ShrinkConfig", "expand_config", "lora_expand", "lora_expand_with", "lora_shrink",
           "lora_shrink_with", "shrink_config"]

MAX_SLICES = 3  # q/k/v


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # tokens per tile
    block_k: int  # reduction step
    splits: int  # K ranges (P), each a program writing its own partial sum
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int  # tokens per tile
    block_n: int  # output columns per step
    blocks_per_program: int  # column steps of one slice per program (the tile's partials are summed once)
    num_warps: int = 4
    num_stages: int = 2


# Shrink split-K: double the split while the token tiles times the split stay within this many
# programs per SM, each split keeps a K step, and the partials stay few (splits x rows within
# MAX_PARTIAL_ROWS, or MIN_SPLITS splits): each expand program reads its tokens' partials.
# On an H100 (benchmarks/lora_kernels.py --sweep, Llama 1B and 8B projections) the shrink alone was
# fastest with 16 to 32 splits from 1 to 256 rows; 8 at 256 rows cost it up to 2.3 us (8B down).
SHRINK_PROGRAMS_PER_SM = 4
MAX_SPLITS = 32
MIN_SPLITS = 8
MAX_PARTIAL_ROWS = 1024
# Expand: each column program of a token tile re-reads the tile's partials (splits x R float32 a
# row) to stream block_n x blocks_per_program columns of y; widen the programs until the partials
# are at most a quarter of y's bytes, while the tiles' column programs still number
# EXPAND_PROGRAMS_PER_SM per SM (fewer left the SMs idle in the sweep).
PARTIAL_SHARE = 4
EXPAND_PROGRAMS_PER_SM = 2
MAX_BLOCKS_PER_PROGRAM = 8
# Expand loads a tile's split-K partials in chunks of at most this many elements (registers).
_CHUNK = 4096


def shrink_config(rows: int, n: int, k: int, sm_count: int = 0) -> ShrinkConfig:
    """Launch parameters of ``lora_shrink`` for ``rows`` tokens, ``n = slices * R`` output and ``k``
    input columns on a GPU of ``sm_count`` SMs (0: no split)."""
    # Small tiles keep batches below a few thousand rows on every SM; past that, 64-row tiles read A less often.
    block_m = 64 if sm_count and triton.cdiv(rows, 64) >= SHRINK_PROGRAMS_PER_SM * sm_count else 16
    block_k = max(16, min(128, 8192 // _padded(n), triton.next_power_of_2(k)))  # an A tile of <= 16 KB in bf16
    tiles, steps = triton.cdiv(rows, block_m), triton.cdiv(k, block_k)
    splits = 1
    while (sm_count and splits * 2 <= min(MAX_SPLITS, steps) and tiles * splits * 2 <= SHRINK_PROGRAMS_PER_SM * sm_count
           and splits * 2 <= max(MIN_SPLITS, MAX_PARTIAL_ROWS // rows)):
        splits *= 2
    return ShrinkConfig(block_m=block_m, block_k=block_k, splits=splits)


def expand_config(rows: int, widths: tuple[int, ...], rank: int, splits: int, sm_count: int = 0) -> ExpandConfig:
    """Launch parameters of ``lora_expand`` for ``rows`` tokens, slices of ``widths`` output columns,
    rank ``rank`` and ``splits`` shrink partials on a GPU of ``sm_count`` SMs (0: one column step
    per program)."""
    block_m = 16 if rows <= 256 else 64  # small tiles: more programs streaming y at decode sizes
    block_n = max(16, min(128, triton.next_power_of_2(max(widths))))
    tiles = triton.cdiv(rows, block_m)
    per_program = 1
    while (sm_count and per_program * 2 <= MAX_BLOCKS_PER_PROGRAM
           and PARTIAL_SHARE * splits * rank > block_n * per_program
           and tiles * _column_programs(widths, block_n, per_program * 2) >= EXPAND_PROGRAMS_PER_SM * sm_count):
        per_program *= 2
    return ExpandConfig(block_m=block_m, block_n=block_n, blocks_per_program=per_program)


def _padded(n: int) -> int:
    """``n`` columns as a tile dimension: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(n))


def _column_programs(widths: tuple[int, ...], block_n: int, per_program: int) -> int:
    return sum(triton.cdiv(triton.cdiv(width, block_n), per_program) for width in widths)


@triton.jit
def _slot_tile(order_ptr, starts_ptr, counts_ptr, num_slots, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program ``program_id(0)``'s slot and tokens: the slots' token tiles numbered in slot order.
    Returns the slot (``num_slots`` past the last tile), the tile's token indices and which of
    its rows are tokens."""
    slots = tl.arange(0, BLOCK_L)
    is_slot = slots < num_slots
    counts = tl.load(counts_ptr + slots, mask=is_slot, other=0)
    starts = tl.load(starts_ptr + slots, mask=is_slot, other=0)  # with the counts: one memory round trip, not two
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    index = tl.program_id(0)
    slot = tl.sum((ends <= index).to(tl.int32), 0)
    mine = slots == slot
    rows = (index - tl.sum(tl.where(mine, ends - tiles, 0), 0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    is_row = rows < tl.sum(tl.where(mine, counts, 0), 0)
    tokens = tl.load(order_ptr + tl.sum(tl.where(mine, starts, 0), 0) + rows, mask=is_row, other=0).to(tl.int64)
    return slot, tokens, is_row


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, order_ptr, starts_ptr, counts_ptr, num_slots, n, k, split_steps,
                   x_stride_t, x_stride_k, a_stride_l, a_stride_n, a_stride_k, out_stride_p, out_stride_t,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid: (token tiles, splits). ``out[split, tokens] = x[tokens] @ A[slot].T`` over the
    split's K steps (zeros for a split past the last step)."""
    slot, tokens, is_row = _slot_tile(order_ptr, starts_ptr, counts_ptr, num_slots, BLOCK_M, BLOCK_L)
    if slot >= num_slots:
        return
    cols = tl.arange(0, BLOCK_N)
    is_col = cols < n
    split = tl.program_id(1)
    first = split * split_steps
    a_tile = a_ptr + slot.to(tl.int64) * a_stride_l + cols[None, :] * a_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, tl.minimum(first + split_steps, tl.cdiv(k, BLOCK_K))):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = ks < k
        x = tl.load(x_ptr + tokens[:, None] * x_stride_t + ks[None, :] * x_stride_k,
                    mask=is_row[:, None] & in_k[None, :], other=0.0)
        a = tl.load(a_tile + ks[:, None] * a_stride_k, mask=in_k[:, None] & is_col[None, :], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    tl.store(out_ptr + split.to(tl.int64) * out_stride_p + tokens[:, None] * out_stride_t + cols[None, :], acc,
             mask=is_row[:, None] & is_col[None, :])


@triton.jit
def _pick(index, first, second, third):
    """The ``index``-th of three scalars."""
    return tl.where(index == 0, first, tl.where(index == 1, second, third))


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, order_ptr, starts_ptr, counts_ptr, num_slots, rank,
                   y_stride_t, y_stride_n, h_stride_p, h_stride_t, b_stride_l, b_stride_n, b_stride_r,
                   start_0, start_1, start_2, start_3, programs_1, programs_2,
                   NUM_SLICES: tl.constexpr, SPLITS: tl.constexpr, CHUNK_P: tl.constexpr, PER_PROGRAM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Grid: (token tiles, column programs); slice ``i``'s column programs start at
    ``programs_i`` (``programs_0 = 0``), its output columns at ``start_i``."""
    slot, tokens, is_row = _slot_tile(order_ptr, starts_ptr, counts_ptr, num_slots, BLOCK_M, BLOCK_L)
    if slot >= num_slots:
        return
    program = tl.program_id(1)
    piece = tl.full((), 0, tl.int32)  # the slice of this program's columns
    if NUM_SLICES > 1:
        piece += (program >= programs_1).to(tl.int32)
    if NUM_SLICES > 2:
        piece += (program >= programs_2).to(tl.int32)
    end = _pick(piece, start_1, start_2, start_3)
    first_col = _pick(piece, start_0, start_1, start_2) + (program - _pick(piece, 0, programs_1, programs_2)) * (
        PER_PROGRAM * BLOCK_N)
    # The tile's rows of this slice of the shrunk activations, its split-K partials summed.
    r = tl.arange(0, BLOCK_R)
    in_r = r < rank
    h_tile = h_ptr + tokens[None, :, None] * h_stride_t + (piece * rank + r)[None, None, :]
    h_mask = is_row[None, :, None] & in_r[None, None, :]
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for first in tl.static_range(0, SPLITS, CHUNK_P):  # a few wide loads, all in flight together
        splits = first + tl.arange(0, CHUNK_P)
        h += tl.sum(tl.load(h_tile + splits[:, None, None] * h_stride_p, mask=h_mask & (splits < SPLITS)[:, None, None],
                            other=0.0), axis=0)
    b_tile = b_ptr + slot.to(tl.int64) * b_stride_l + r[:, None] * b_stride_r
    for step in range(PER_PROGRAM):
        cols = first_col + step * BLOCK_N + tl.arange(0, BLOCK_N)
        is_col = cols < end
        b = tl.load(b_tile + cols[None, :] * b_stride_n, mask=in_r[:, None] & is_col[None, :], other=0.0)
        delta = tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION)
        y_tile = y_ptr + tokens[:, None] * y_stride_t + cols[None, :] * y_stride_n
        mask = is_row[:, None] & is_col[None, :]
        y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_tile, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _sm_count(tensor: torch.Tensor) -> int:
    """SMs to fill on ``tensor``'s device; 0 elsewhere (the interpreter), where nothing is split."""
    return num_sms(tensor.device) if tensor.is_cuda else 0


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_order: torch.Tensor, slot_starts: torch.Tensor,
                slot_counts: torch.Tensor) -> torch.Tensor:
    """The reference's ``lora_shrink`` (``[P, T, N]`` float32 partials) at ``shrink_config``."""
    config = shrink_config(x.shape[0], lora_a.shape[1], x.shape[1], _sm_count(x))
    return lora_shrink_with(x, lora_a, token_order, slot_starts, slot_counts, config)


def lora_shrink_with(x: torch.Tensor, lora_a: torch.Tensor, token_order: torch.Tensor, slot_starts: torch.Tensor,
                     slot_counts: torch.Tensor, config: ShrinkConfig) -> torch.Tensor:
    """``lora_shrink`` with explicit launch parameters (tests, tuning). ``x`` may have any strides."""
    rows, k = x.shape
    num_slots, n, _ = lora_a.shape
    out = torch.empty((config.splits, rows, n), dtype=torch.float32, device=x.device)
    if rows == 0 or num_slots == 0:
        return out
    steps = triton.cdiv(k, config.block_k)
    grid = (triton.cdiv(rows, config.block_m) + num_slots - 1, config.splits)
    _shrink_kernel[grid](
        x, lora_a, out, token_order, slot_starts, slot_counts, num_slots, n, k, triton.cdiv(steps, config.splits),
        *x.stride(), *lora_a.stride(), out.stride(0), out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=_padded(n), BLOCK_K=config.block_k,
        BLOCK_L=triton.next_power_of_2(num_slots), DOT_DTYPE=_dot_dtype(x.dtype), DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, slice_starts: tuple[int, ...],
                token_order: torch.Tensor, slot_starts: torch.Tensor, slot_counts: torch.Tensor) -> None:
    """The reference's ``lora_expand`` (in place) at ``expand_config``."""
    widths = tuple(end - start for start, end in zip(slice_starts, slice_starts[1:]))
    config = expand_config(y.shape[0], widths, lora_b.shape[2], shrunk.shape[0], _sm_count(y))
    lora_expand_with(y, shrunk, lora_b, slice_starts, token_order, slot_starts, slot_counts, config)


def lora_expand_with(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, slice_starts: tuple[int, ...],
                     token_order: torch.Tensor, slot_starts: torch.Tensor, slot_counts: torch.Tensor,
                     config: ExpandConfig) -> None:
    """``lora_expand`` with explicit launch parameters (tests, tuning). ``y`` may be any view, such
    as a fused projection's output columns of a wider tensor."""
    rows = y.shape[0]
    num_slots, _, rank = lora_b.shape
    num_slices = len(slice_starts) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"lora_expand takes 1 to {MAX_SLICES} slices, got slice_starts {slice_starts}")
    if rows == 0 or num_slots == 0:
        return
    widths = [end - start for start, end in zip(slice_starts, slice_starts[1:])]
    programs = [triton.cdiv(triton.cdiv(width, config.block_n), config.blocks_per_program) for width in widths]
    first_programs = [sum(programs[:i]) for i in range(1, MAX_SLICES)]  # slice i's first column program
    starts = list(slice_starts) + [slice_starts[-1]] * (MAX_SLICES + 1 - len(slice_starts))
    splits, block_r = shrunk.shape[0], _padded(rank)
    chunk = min(triton.next_power_of_2(splits), max(1, _CHUNK // (config.block_m * block_r)))
    grid = (triton.cdiv(rows, config.block_m) + num_slots - 1, sum(programs))
    _expand_kernel[grid](
        y, shrunk, lora_b, token_order, slot_starts, slot_counts, num_slots, rank,
        *y.stride(), shrunk.stride(0), shrunk.stride(1), *lora_b.stride(), *starts, *first_programs,
        NUM_SLICES=num_slices, SPLITS=splits, CHUNK_P=chunk, PER_PROGRAM=config.blocks_per_program,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_R=block_r,
        BLOCK_L=triton.next_power_of_2(num_slots), DOT_PRECISION=_dot_precision(y.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
