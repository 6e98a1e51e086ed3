"""Triton kernels for the paged KV cache: ``store_kv`` and ``paged_attention``.

Same signatures and semantics as :mod:`hookllm.kernels.reference` (read it for the cache
layout). One attention kernel serves prefill chunks, decodes and mixed batches:

* A program owns one block of ``BLOCK_M`` query tokens of one sequence and one KV head. Its
  query tile stacks the ``group`` query heads that share that KV head, ``[BLOCK_M * group,
  head_dim]`` rows, so every KV tile is read once per KV head (GQA) and fed to tensor cores.
* KV tiles of ``BLOCK_N`` keys are gathered through the block table independently of the
  cache's ``block_size``; tiles that lie wholly before the diagonal (and, with a sliding
  window, wholly inside every row's window) skip the mask. With a window, tiles wholly before
  every row's window are not visited, and keys before it are never loaded, so their blocks
  may hold anything.
* The variants (sliding window, logit soft-capping, attention sinks, bidirectional attention)
  are constexpr flags: the plain kernel is compiled as before, and a model compiles each
  variant its layers use once.
* Softmax is online (flash-attention style) in fp32, in base 2 with the scale folded in.
* An FP8 (e4m3) cache is read as stored and converted in registers; its per-tensor K scale is
  folded into the scores' scale and its V scale into the output's normalisation. Its dots run
  in fp16, not bf16: e4m3 converts to fp16 in one instruction per pair (to bf16 it takes
  several), and every e4m3 value, bf16 query (short of 65504) and probability is as exact in
  fp16 or more.
* Split-K (flash-decoding): when a decode-only batch has too few (sequence, KV head) pairs
  to fill the GPU, each pair's keys (those in its window) are cut into ``num_splits`` ranges
  handled by separate programs that write partial results; a second kernel merges them and
  adds the sinks.
* A batch with prefill launches the kernel twice: its decodes with the decode tiles, then its
  prefill chunks with the prefill tiles (``SEQS``); each launch covers every sequence and skips
  the other's, so the grids depend on shapes alone (CUDA graphs).

Nothing here reads device tensors on the host: grid sizes come from tensor shapes and the
python ints ``max_query_len`` / ``max_seq_len``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy: they may read only constexpr globals
# By head_dim (64 also serves smaller ones), tuned on an H200 at bf16:
# decode (block_n, num_warps, num_stages); prefill (query rows, block_n, num_warps, num_stages).
_DECODE_CONFIGS = {64: (128, 4, 3), 128: (64, 4, 2), 256: (32, 4, 2)}
_PREFILL_CONFIGS = {64: (128, 64, 8, 2), 128: (64, 64, 4, 3), 256: (64, 32, 8, 2)}
# Over an FP8 cache (fp16 dots), tuned on an H200 (benchmarks/attention.py --kv-cache-dtype fp8);
# head_dim 256 untuned, as bf16.
_FP8_DECODE_CONFIGS = {64: (256, 4, 2), 128: (64, 2, 3), 256: (32, 4, 2)}
_FP8_PREFILL_CONFIGS = {64: (128, 64, 4, 3), 128: (128, 64, 4, 3), 256: (64, 32, 8, 2)}
# Split-K: fill about this many resident decode programs per SM; never give a split fewer
# than MIN_SPLIT_TOKENS keys.
PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# A batch with prefill runs its decodes in a launch of their own, with the decode tiles (one
# query token per program; benchmarks/attention.py --mixed compares); SEQS says which
# sequences a launch serves.
SEPARATE_DECODES = True
ALL_SEQS, DECODE_SEQS, PREFILL_SEQS = 0, 1, 2
_DECODE_SEQS, _PREFILL_SEQS = tl.constexpr(DECODE_SEQS), tl.constexpr(PREFILL_SEQS)
# Decided when the kernels below are defined, as triton.jit itself decides it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = tl.constexpr(448.0)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_kv_heads, k_scale, v_scale,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < num_kv_heads
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + h * stride_kch + d * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + h * stride_vch + d * stride_vcd
    if FP8:  # the reference's to_fp8: divide, saturate, round
        k = tl.clamp(k.to(tl.float32) / k_scale, -_FP8_MAX, _FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -_FP8_MAX, _FP8_MAX)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each new token's K and V into its slot of the paged cache, in place (-1 = skip);
    an FP8 cache stores them divided by ``k_scale`` / ``v_scale``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        num_kv_heads, k_scale, v_scale,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        FP8=k_cache.dtype == FP8_DTYPE,
    )


@triton.jit
def _find_seq(query_start_loc_ptr, block_idx, num_seqs, BLOCK_M: tl.constexpr):
    """The sequence owning query block ``block_idx``; sequence i's blocks start at
    ``query_start_loc[i] // BLOCK_M + i`` (an upper bound that needs no prefix sum)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        if first_block <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh through exp of a non-positive number, which cannot overflow (the interpreter has no
    libdevice tanh)."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos,
    k_base, v_base, block_table_row, lo, hi, kv_start, kv_end, qk_scale, cap, window, offs_d, d_ok,
    stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) over keys ``lo..hi`` in tiles of BLOCK_N.

    Scores are ``dot * qk_scale`` in base 2, or with USE_SOFTCAP ``cap * tanh(dot * qk_scale)``.
    With MASKED the tiles may reach past a row's diagonal (CAUSAL), outside its window or outside
    ``kv_start..kv_end`` (keys there are not loaded: they read as 0 and are masked); without
    it every key in range is visible to every query row."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        if MASKED:
            in_range = pos < kv_end
            if USE_WINDOW:
                in_range = in_range & (pos >= kv_start)
            block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=in_range, other=0)
            kv_mask = in_range[:, None] & d_ok[None, :]
        else:
            block = tl.load(block_table_row + pos // BLOCK_SIZE)
            kv_mask = d_ok[None, :]
        block = block.to(tl.int64)
        slot_in_block = (pos % BLOCK_SIZE)[:, None]
        k = tl.load(
            k_base + block[:, None] * stride_kb + slot_in_block * stride_kt + offs_d[None, :] * stride_kd,
            mask=kv_mask, other=0.0,
        )
        v = tl.load(
            v_base + block[:, None] * stride_vb + slot_in_block * stride_vt + offs_d[None, :] * stride_vd,
            mask=kv_mask, other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:
            s = cap * _tanh(s)
        if MASKED:
            if CAUSAL:
                visible = pos[None, :] <= q_pos[:, None]
            else:
                visible = (pos < kv_end)[None, :] & (q_pos >= 0)[:, None]
            if USE_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
                if not CAUSAL:
                    visible = visible & (pos[None, :] < q_pos[:, None] + window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Arguments that change from step to step are not specialized (Triton otherwise compiles a new
# variant when an int turns 1 or a multiple of 16: seconds of compiling in the middle of serving);
# nor is the window, so that every window size shares one variant.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    num_seqs, num_heads, qk_scale, cap, window, v_scale,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ONE_BLOCK_PER_SEQ: tl.constexpr, SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SEQS: tl.constexpr,
):
    """Grid: (query blocks, KV heads, splits). Writes the normalised output, or with SPLIT the
    unnormalised partial sums, running max and denominator of this program's key range (the
    sinks are then the merge's to add: USE_SINKS only without SPLIT). SEQS picks the sequences
    it serves: ALL_SEQS, DECODE_SEQS (one query token) or PREFILL_SEQS (the others)."""
    kv_head = tl.program_id(1)
    if ONE_BLOCK_PER_SEQ:
        seq = tl.program_id(0)
        q_block = 0
    else:
        # Last blocks first: a sequence's later query blocks see more keys, so start them early.
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_M)
        q_block = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_M + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_M >= q_len:
        return
    if SEQS == _DECODE_SEQS:
        if q_len != 1:
            return
    if SEQS == _PREFILL_SEQS:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the tile is query token r // GROUP_PAD of this block, head r % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_R)
    tok = q_block * BLOCK_M + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows // GROUP_PAD < BLOCK_M) & (tok < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=io_mask, other=0.0,
    ).to(DOT_DTYPE)

    # Keys this block attends to: kv_start..kv_end, kv_start the first key in the window of its
    # first row (0 without a window); before `unmasked_end` no row needs the causal mask (nor,
    # bidirectional, the mask of the sequence's end).
    q_first = context_len + q_block * BLOCK_M
    q_end = context_len + tl.minimum((q_block + 1) * BLOCK_M, q_len)
    if CAUSAL:
        kv_end = q_end
        unmasked_end = (q_first + 1) // BLOCK_N * BLOCK_N
    else:
        kv_end = seq_len
        if USE_WINDOW:
            kv_end = tl.minimum(kv_end, q_end - 1 + window)
        unmasked_end = kv_end // BLOCK_N * BLOCK_N
    if USE_WINDOW:
        kv_start = tl.maximum(q_first - window + 1, 0)
        first_tile = kv_start // BLOCK_N * BLOCK_N  # the tiles before it are skipped
    else:
        kv_start = 0
        first_tile = 0
    if SPLIT:
        split = tl.program_id(2)
        split_len = tl.cdiv(tl.cdiv(kv_end - first_tile, BLOCK_N), tl.num_programs(2)) * BLOCK_N
        lo = first_tile + split * split_len
        hi = tl.minimum(lo + split_len, kv_end)
    else:
        lo = first_tile
        hi = kv_end
    mid = tl.minimum(tl.maximum(unmasked_end, lo), hi)

    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    if USE_SINKS:
        # The sink as one more key, of value 0: the running max starts at it, the denominator at 1.
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E
        l_i = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_R], -1e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if USE_WINDOW:
        # Keys from kv_end - window on lie in every row's window; the tiles before need its mask.
        # Bidirectional, every tile may lie outside some row's window: all take the mask.
        if CAUSAL:
            window_end = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, lo), hi)
        else:
            window_end = hi
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, k_base, v_base, block_table_row, lo, window_end, kv_start, kv_end,
            qk_scale, cap, window, offs_d, d_ok, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            True, CAUSAL, USE_WINDOW, USE_SOFTCAP, BLOCK_N, BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION,
        )
        lo = window_end
        mid = tl.maximum(mid, window_end)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, block_table_row, lo, mid, kv_start, kv_end,
        qk_scale, cap, window, offs_d, d_ok, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        False, CAUSAL, USE_WINDOW, USE_SOFTCAP, BLOCK_N, BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION,
    )
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, block_table_row, mid, hi, kv_start, kv_end,
        qk_scale, cap, window, offs_d, d_ok, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
        True, CAUSAL, USE_WINDOW, USE_SOFTCAP, BLOCK_N, BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION,
    )

    if SPLIT:
        part = ((q_start + tok) * num_heads + head) * tl.num_programs(2) + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=io_mask)
    else:
        out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        tl.store(
            out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty), mask=io_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, sinks_ptr,
    num_heads, num_splits, v_scale,
    stride_ot, stride_oh, stride_od,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """Grid: (tokens, heads). Rescales each split's partial sums to the global max (over the
    splits and the head's sink) and normalises, the sink joining the denominator."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = (token * num_heads + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)
    denominator = tl.sum(l * w, 0)
    if USE_SINKS:
        denominator = denominator + tl.exp2(sink - m_max)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=split_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) * (v_scale / denominator)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM,
    )


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the attention kernel."""

    block_m: int  # query tokens per program (times the GQA group gives the tile's rows)
    block_n: int  # keys per KV tile
    num_warps: int
    num_stages: int


def default_config(head_dim: int, group: int, max_query_len: int, fp8_cache: bool = False) -> AttentionConfig:
    """Tile sizes for a batch shape (and cache dtype), tuned on an H200 (docs/performance.md): one
    query token per program for decode-only batches (memory-bound), 64-128-row query tiles otherwise."""
    key = min(max(head_dim, 64), 256)
    if max_query_len <= 1:
        block_n, num_warps, num_stages = (_FP8_DECODE_CONFIGS if fp8_cache else _DECODE_CONFIGS)[key]
        return AttentionConfig(block_m=1, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    rows, block_n, num_warps, num_stages = (_FP8_PREFILL_CONFIGS if fp8_cache else _PREFILL_CONFIGS)[key]
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, min(rows // group_pad, triton.next_power_of_2(max_query_len)))
    return AttentionConfig(
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps if block_m * group_pad >= rows else 4,
        num_stages=num_stages,
    )


def _dot_dtype(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> tl.dtype:
    """Operand type of the tensor-core dots: the input's, except bf16 under the Triton
    interpreter, whose tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584), and fp16
    for 16-bit inputs over an FP8 cache (see the module's docstring)."""
    if INTERPRETED and dtype == torch.bfloat16:
        return tl.float32
    if cache_dtype == FP8_DTYPE and dtype != torch.float32:
        return tl.float16
    return _TL_DTYPES[dtype]


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the CPU count elsewhere), cached."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """How many key ranges each (sequence, KV head) is cut into: more than one only for
    decode-only batches with too few (sequence, KV head) programs to fill the SMs' resident
    slots, and only for long contexts."""
    if max_query_len != 1:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    splits = min(
        PROGRAMS_PER_SM * num_sms // programs,
        max_seq_len // MIN_SPLIT_TOKENS,
        MAX_SPLITS,
    )
    return max(1, splits)


def paged_attention_with(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int,
    config: AttentionConfig,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    causal: bool = True,
    seqs: int = ALL_SEQS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` with an explicit split count and launch config (tests, tuning); with
    ``seqs`` = DECODE_SEQS or PREFILL_SEQS only those sequences' rows of ``out`` are written."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size % 16:
        raise ValueError(f"block_size must be a multiple of 16, got {block_size}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = config.block_m
    one_block_per_seq = max_query_len <= block_m or seqs == DECODE_SEQS
    num_q_blocks = num_seqs if one_block_per_seq else num_tokens // block_m + num_seqs
    block_d = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device)
    else:
        part_m = part_l = part_acc = out  # unused
    # With a softcap the kernel computes softcap * LOG2E * tanh(dot * scale / softcap). An FP8
    # cache's scales fold into the scores' scale and the output's: the tiles stay as loaded.
    scale = scale * k_scale
    qk_scale = scale * LOG2E if softcap is None else scale / softcap
    cap = 0.0 if softcap is None else softcap * LOG2E
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_acc, part_m, part_l,
        block_tables, seq_lens, query_start_loc, None if split else sinks,
        num_seqs, num_heads, qk_scale, cap, 0 if sliding_window is None else sliding_window, v_scale,
        *query.stride(), *out.stride(), *k_cache.stride()[:4], *v_cache.stride()[:4],
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_R=max(16, block_m * group_pad), BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d,
        ONE_BLOCK_PER_SEQ=one_block_per_seq, SPLIT=split, CAUSAL=causal,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None and not split,
        DOT_DTYPE=_dot_dtype(query.dtype, k_cache.dtype),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SEQS=seqs,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_m, part_l, out, sinks, num_heads, num_splits, v_scale, *out.stride(),
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
            USE_SINKS=sinks is not None,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    causal: bool = True,
) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks and decodes) over the paged cache,
    optionally with a sliding window, logit soft-capping and attention sinks, or bidirectional
    attention (``causal=False``: encoders).

    See :func:`hookllm.kernels.reference.paged_attention` for the exact semantics. Picks the
    split-K path for decode-only batches that would not fill the GPU on their own (a decode
    reads at most ``sliding_window`` keys)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    keys = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    group, fp8_cache = num_heads // num_kv_heads, k_cache.dtype == FP8_DTYPE
    num_splits = num_kv_splits(seq_lens.shape[0], num_kv_heads, max_query_len, keys, num_sms(query.device))
    attend = functools.partial(paged_attention_with, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                               scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                               k_scale=k_scale, v_scale=v_scale, causal=causal)
    if max_query_len <= 1 or not SEPARATE_DECODES:
        return attend(max_query_len=max_query_len, num_splits=num_splits,
                      config=default_config(head_dim, group, max_query_len, fp8_cache))
    # With prefill: the decodes with the decode tiles (a prefill tile would hold one real query
    # token of its 16 or more), then the prefill chunks; each launch skips the other's sequences.
    out = attend(max_query_len=1, num_splits=1, config=default_config(head_dim, group, 1, fp8_cache), seqs=DECODE_SEQS)
    return attend(max_query_len=max_query_len, num_splits=1, seqs=PREFILL_SEQS, out=out,
                  config=default_config(head_dim, group, max_query_len, fp8_cache))
