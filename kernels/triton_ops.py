"""Triton kernels for the small per-layer ops and the sampler's last pass.

``rms_norm`` (with the residual add fused), ``apply_rotary``, ``silu_and_mul``,
``filter_thresholds``, ``sample_with_hashed_noise``, ``token_logprobs``, ``apply_penalties`` and
``apply_token_bitmask`` have the signatures and semantics of their twins in
:mod:`hookllm.kernels.reference`, including where results are rounded to the model dtype. In
torch each is five to twenty elementwise kernels over the batch; here each is one, which in a
decode step (hundreds of tiny kernels per forward) is most of the non-matmul time.

``sample_with_hashed_noise``: programs stream a row's logits (any float dtype) once, a range of
columns each, hashing each token's noise from the row's key in registers (greedy rows skip it)
and keeping a running best score per lane, instead of the torch version's hash passes over a ``[rows, vocab]`` int64
tensor and its five passes (scale, softmax, divide, argmax) over the float32 scores.

``filter_thresholds``: one program per row finds the smallest logit its top-k, top-p (over the
renormalized top k) and min-p keep without sorting the row: two passes (lane maxima and mass,
then the candidates above the k-th largest lane maximum), a sort of the candidates in
registers, and an exact search over the floats' order-preserving integer keys for the rows
whose candidates do not suffice (with a pass for the top k's mass where a top-p needs it). A
nucleus alone on a flat row (most of the vocabulary) is found by programs over column ranges
instead: rounds that narrow a bracket around it, then a gather and sort of the bracket's logits.

``token_logprobs``: one program per row reads it once for the chosen token's logprob and rank
(an online log-sum-exp and a count of the larger logits), where the torch version writes the
row's whole ``log_softmax`` and reads it three more times; the top n come from a second pass
that keeps the logits at or above the n-th largest lane maximum, sorted in registers (torch's
top-k of a 128k-token row took 0.5 ms of the 0.585 at 256 rows on an H100).

``apply_penalties`` and ``apply_token_bitmask``: one program per (row, column block) reads the
row's tables or mask bits and writes the adjusted logits in place, instead of the torch
versions' gathers, elementwise passes and scatters, each a launch on the step's critical path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hookllm.kernels.triton_attention import num_sms
from hookllm.kernels.triton_fp8 import quantize_fp8, scaled_matmul  # noqa: F401 - ops_for serves them too
from hookllm.kernels.triton_lora import lora_expand, lora_shrink  # noqa: F401 - ops_for serves them too

BLOCK = 2048
# The sampling kernel cuts rows into column ranges until about this many programs run per SM,
# each of SAMPLER_WARPS warps walking its range SAMPLER_BLOCK columns at a time.
# Measured on an H200 (benchmarks/sampling.py --tune): at 256 rows of a 128,256-token vocabulary
# 0.107 ms against 0.186 with 2 programs of 4 warps over 2,048 columns; 4.6 us slower at 1 row.
SAMPLER_PROGRAMS_PER_SM = 16
SAMPLER_WARPS = 8
SAMPLER_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden, x_stride, residual_stride,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(residual_out_ptr.dtype.element_ty)  # rounded like torch's add
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    residual_out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device) if residual is not None else out
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, residual_out, hidden,
                                  x.stride(0), residual.stride(0) if residual is not None else 0, eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out if residual is None else (out, residual_out)


@triton.jit
def _rotate_heads(x_ptr, row_stride, num_heads, cos, sin, token, d, HALF, BLOCK_H: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    ptrs = x_ptr + token * row_stride + heads[:, None] * (2 * HALF) + d[None, :]
    mask = (heads[:, None] < num_heads) & (d[None, :] < HALF)
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_stride, k_stride, cos_sin_stride, num_q_heads,
                   num_k_heads, HALF, BLOCK_D: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_sin_ptr + position * cos_sin_stride + d, mask=d < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + position * cos_sin_stride + HALF + d, mask=d < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr, q_stride, num_q_heads, cos, sin, token, d, HALF, BLOCK_QH)
    _rotate_heads(k_ptr, k_stride, num_k_heads, cos, sin, token, d, HALF, BLOCK_KH)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                 head_dim: int) -> None:
    num_tokens = q.shape[0]
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](positions, q, k, cos_sin, q.stride(0), k.stride(0), cos_sin.stride(0),
                                      q.shape[1] // head_dim, k.shape[1] // head_dim, half,
                                      BLOCK_D=triton.next_power_of_2(half),
                                      BLOCK_QH=triton.next_power_of_2(q.shape[1] // head_dim),
                                      BLOCK_KH=triton.next_power_of_2(k.shape[1] // head_dim))


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, d, in_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * d + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, d), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(d))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](gate_up, out, d, gate_up.stride(0), BLOCK=block)
    return out


@triton.jit
def _fmix32(h):
    # murmur3's 32-bit finalizer on uint32 lanes: products wrap mod 2^32, as the reference's do.
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _sample_with_hashed_noise_kernel(logits_ptr, keys_ptr, temperature_ptr, threshold_ptr, best_ptr, best_col_ptr,
                                     vocab, logits_stride, split_len, HAS_THRESHOLD: tl.constexpr,
                                     BLOCK: tl.constexpr):
    row, split = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    sampled = temperature > 0.0
    divisor = tl.where(sampled, temperature, 1.0)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < hi
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        if sampled:  # greedy rows skip the hash
            # The reference's hashed_exponential_noise, element by element (u exact in float32).
            bits = _fmix32(key ^ _fmix32(cols.to(tl.uint32) ^ 0x9E3779B9)) >> 9
            q = -tl.log((bits.to(tl.float32) + 0.5) * 1.1920928955078125e-07)  # 2^-23
            score = x / divisor - tl.log(q)
            if HAS_THRESHOLD:  # the row's top-k / top-p / min-p, one logit
                score = tl.where(x >= tl.load(threshold_ptr + row), score, float("-inf"))
        else:
            score = x
        better = score > best  # strict: each lane keeps its first column among equals
        best = tl.where(better, score, best)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best, axis=0)
    # The first column holding the top score, as torch.argmax picks it.
    tl.store(best_ptr + row * tl.num_programs(1) + split, top)
    tl.store(best_col_ptr + row * tl.num_programs(1) + split, tl.min(tl.where(best == top, best_col, vocab), axis=0))


@triton.jit(do_not_specialize=["splits"])
def _pick_best_split_kernel(best_ptr, best_col_ptr, out_ptr, vocab, splits, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    best = tl.load(best_ptr + row * splits + s, mask=s < splits, other=float("-inf"))
    best_col = tl.load(best_col_ptr + row * splits + s, mask=s < splits, other=vocab)
    # Splits hold ascending column ranges, each its first best column: the lowest among the
    # splits that hold the top score is the row's first.
    col = tl.min(tl.where(best == tl.max(best, axis=0), best_col, vocab), axis=0)
    tl.store(out_ptr + row, tl.minimum(col, vocab - 1).to(tl.int64))


def sample_with_hashed_noise(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                             threshold: torch.Tensor | None = None) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if not rows:
        return out
    # The kernel reads temperature[row] (and threshold[row]) at row: a strided view (the sampler's
    # params[:, 0]) is copied.
    temperature = temperature.contiguous()
    threshold = None if threshold is None else threshold.contiguous()
    block = min(SAMPLER_BLOCK, triton.next_power_of_2(vocab))
    # Each row's vocabulary is cut into column ranges that separate programs scan, as many as
    # fill the SMs when there are few rows; a second kernel picks the best of each row's ranges.
    # Both kernels' variants depend only on the vocabulary, so no batch size compiles a new one.
    blocks = triton.cdiv(vocab, block)
    splits = max(1, min(blocks, SAMPLER_PROGRAMS_PER_SM * num_sms(logits.device) // rows))
    split_len = triton.cdiv(blocks, splits) * block
    splits = triton.cdiv(vocab, split_len)
    best = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    best_col = torch.empty((rows, splits), dtype=torch.int32, device=logits.device)
    _sample_with_hashed_noise_kernel[(rows, splits)](logits, keys.contiguous(), temperature, threshold, best, best_col,
                                                     vocab, logits.stride(0), split_len,
                                                     HAS_THRESHOLD=threshold is not None, BLOCK=block,
                                                     num_warps=SAMPLER_WARPS)
    _pick_best_split_kernel[(rows,)](best, best_col, out, vocab, splits, BLOCK_S=triton.next_power_of_2(blocks))
    return out


# The filter kernel's lanes: lane j keeps the largest logit of columns j, j + FILTER_LANES, ...;
# the k-th largest of those maxima is a lower bound on the row's k-th largest logit, and few
# logits lie above it. Up to FILTER_CAPACITY of them are sorted in registers.
FILTER_LANES = 2048
FILTER_CAPACITY = 2048
FILTER_TOP_P_RANK = 512  # a top-p without a top-k first looks for its nucleus among this many
FILTER_PIVOTS = 16  # keys tried per pass of the exact search, when the candidates do not suffice
FILTER_SEARCH_LANES = 512
FILTER_WARPS = 8
# A nucleus that lies below a row's candidates (a flat row: most of the vocabulary) is found by
# programs that each scan a column range, as the sampling kernel's do: NUCLEUS_ROUNDS rounds
# narrow a bracket around it at NUCLEUS_PIVOTS points each, then its logits are gathered and
# sorted. One program per row scanning the row once per pass took 1.7 ms at 256 rows of a
# 128,256-token vocabulary (H200): its passes wait on memory latency.
NUCLEUS_ROUNDS = 3
NUCLEUS_PIVOTS = 16
NUCLEUS_LANES = 256
NUCLEUS_PROGRAMS_PER_SM = 16
NUCLEUS_WARPS = 4


@triton.jit
def _flip(bits):
    # float32 bits <-> int32 keys of the same order (an involution).
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _order_key(x):
    return _flip(x.to(tl.int32, bitcast=True))


@triton.jit
def _key_value(key):
    return _flip(key.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _search_threshold(row_ptr, vocab, lo, hi, top, divisor, target, BY_MASS: tl.constexpr,
                      PIVOTS: tl.constexpr, LANES: tl.constexpr):
    # The smallest logit t of the row with S(t) < target, where S(t) counts the logits above t
    # (or sums their exp((x - top) / T)): given keys lo, hi with S(lo) >= target > S(hi), each
    # pass over the row evaluates S at PIVOTS evenly spaced keys and keeps the bracketing pair,
    # until the keys are adjacent: then hi is a logit of the row (S drops there).
    steps = tl.arange(0, PIVOTS).to(tl.int64)
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while hi - lo > 1:
        keys = lo + ((hi - lo) * steps) // PIVOTS
        pivots = _key_value(keys)
        # Per lane and pivot, summed over the lanes once per pass (not once per tile).
        lane_above = tl.zeros([PIVOTS, LANES], tl.float32)
        for start in range(0, vocab, LANES):
            cols = start + tl.arange(0, LANES)
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            if BY_MASS:
                weight = tl.exp((x - top) / divisor)
            else:
                weight = tl.full([LANES], 1.0, tl.float32)
            lane_above += tl.where(x[None, :] > pivots[:, None], weight[None, :], 0.0)
        below = tl.sum(lane_above, axis=1) < target
        lo = tl.max(tl.where(below, lo, keys), axis=0)
        hi = tl.minimum(hi, tl.min(tl.where(below, keys, hi), axis=0))
    return _key_value(hi)


@triton.jit
def _nucleus_pivots(lo, hi, PIVOTS: tl.constexpr):
    # PIVOTS points of [lo, hi), lo first: half evenly spaced in value (a bracket of similar
    # logits narrows fast), half in float order (so does one spanning many binades).
    HALF: tl.constexpr = PIVOTS // 2
    steps = tl.arange(0, PIVOTS)
    in_value = steps < HALF
    share = tl.where(in_value, steps, 0).to(tl.float32) / HALF
    key_lo = _order_key(lo).to(tl.int64)
    key_steps = tl.where(in_value, 0, steps - HALF).to(tl.int64)
    by_key = _key_value(key_lo + ((_order_key(hi).to(tl.int64) - key_lo) * key_steps) // HALF)
    pivots = tl.where(in_value, lo * (1.0 - share) + hi * share, by_key)
    return tl.minimum(tl.maximum(pivots, lo), hi)


@triton.jit(do_not_specialize=["splits"])
def _nucleus_round_kernel(logits_ptr, temperature_ptr, state_ptr, partial_ptr, vocab, logits_stride, split_len,
                          splits, PIVOTS: tl.constexpr, LANES: tl.constexpr):
    # Each program: the mass of its column range's logits above each pivot of its row.
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(state_ptr + row * 4 + 2) >= 0.0:  # the row searches
        lo = tl.load(state_ptr + row * 4)
        hi = tl.load(state_ptr + row * 4 + 1)
        top = tl.load(state_ptr + row * 4 + 3)
        divisor = tl.load(temperature_ptr + row)
        pivots = _nucleus_pivots(lo, hi, PIVOTS)
        lane_mass = tl.zeros([PIVOTS, LANES], tl.float32)
        row_ptr = logits_ptr + row * logits_stride
        end = tl.minimum(vocab, split * split_len + split_len)
        for start in range(split * split_len, end, LANES):
            cols = start + tl.arange(0, LANES)
            x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            lane_mass += tl.where(x[None, :] > pivots[:, None], tl.exp((x - top) / divisor)[None, :], 0.0)
        tl.store(partial_ptr + (row * splits + split) * PIVOTS + tl.arange(0, PIVOTS), tl.sum(lane_mass, axis=1))


@triton.jit(do_not_specialize=["splits"])
def _nucleus_update_kernel(state_ptr, partial_ptr, splits, PIVOTS: tl.constexpr, BLOCK_S: tl.constexpr):
    # The row's bracket (lo, hi] keeps S(lo) >= target > S(hi), S(t) being the mass above t:
    # the tightest pair of pivots that does.
    row = tl.program_id(0)
    target = tl.load(state_ptr + row * 4 + 2)
    if target >= 0.0:
        lo = tl.load(state_ptr + row * 4)
        hi = tl.load(state_ptr + row * 4 + 1)
        pivots = _nucleus_pivots(lo, hi, PIVOTS)
        parts = tl.arange(0, BLOCK_S)[:, None]
        at = partial_ptr + (row * splits + parts) * PIVOTS + tl.arange(0, PIVOTS)[None, :]
        reach = tl.sum(tl.load(at, mask=parts < splits, other=0.0), axis=0) >= target
        tl.store(state_ptr + row * 4, tl.maximum(lo, tl.max(tl.where(reach, pivots, float("-inf")), axis=0)))
        tl.store(state_ptr + row * 4 + 1, tl.minimum(hi, tl.min(tl.where(reach, float("inf"), pivots), axis=0)))


@triton.jit
def _nucleus_gather_kernel(logits_ptr, temperature_ptr, state_ptr, fill_ptr, scratch_ptr, above_ptr, vocab,
                           logits_stride, split_len, CAPACITY: tl.constexpr, LANES: tl.constexpr):
    # Each program appends its column range's logits inside the row's bracket to the row's
    # scratch (counting past CAPACITY), and adds the mass of those above the bracket.
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(state_ptr + row * 4 + 2) >= 0.0:
        lo = tl.load(state_ptr + row * 4)
        hi = tl.load(state_ptr + row * 4 + 1)
        top = tl.load(state_ptr + row * 4 + 3)
        divisor = tl.load(temperature_ptr + row)
        lane_above = tl.zeros([LANES], tl.float32)
        row_ptr = logits_ptr + row * logits_stride
        end = tl.minimum(vocab, split * split_len + split_len)
        for start in range(split * split_len, end, LANES):
            cols = start + tl.arange(0, LANES)
            x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
            lane_above += tl.where(x > hi, tl.exp((x - top) / divisor), 0.0)
            take = ((x > lo) & (x <= hi)).to(tl.int32)
            taken = tl.sum(take, axis=0)
            if taken > 0:
                slot = tl.atomic_add(fill_ptr + row, taken) + tl.cumsum(take, axis=0) - 1
                tl.store(scratch_ptr + row * CAPACITY + slot, x, mask=(take > 0) & (slot < CAPACITY))
        tl.atomic_add(above_ptr + row, tl.sum(lane_above, axis=0))


@triton.jit
def _nucleus_finish_kernel(logits_ptr, temperature_ptr, state_ptr, fill_ptr, scratch_ptr, above_ptr, out_ptr, vocab,
                           logits_stride, CAPACITY: tl.constexpr, PIVOTS: tl.constexpr, SEARCH_LANES: tl.constexpr):
    # The nucleus's edge from the sorted bracket (or, for a bracket the rounds left too full, the
    # one-program search from it), folded into the row's threshold.
    row = tl.program_id(0)
    target = tl.load(state_ptr + row * 4 + 2)
    if target >= 0.0:
        lo = tl.load(state_ptr + row * 4)
        hi = tl.load(state_ptr + row * 4 + 1)
        top = tl.load(state_ptr + row * 4 + 3)
        divisor = tl.load(temperature_ptr + row)
        count = tl.load(fill_ptr + row)
        nucleus = hi
        if count <= CAPACITY:
            slots = tl.arange(0, CAPACITY)
            values = tl.load(scratch_ptr + row * CAPACITY + slots, mask=slots < count, other=float("-inf"))
            values = tl.sort(values, descending=True)
            probs = tl.exp((values - top) / divisor)
            before = tl.load(above_ptr + row) + tl.cumsum(probs, axis=0) - probs
            kept = tl.sum(((before < target) & (slots < count)).to(tl.int32), axis=0)
            if kept > 0:
                nucleus = tl.max(tl.where(slots == kept - 1, values, float("-inf")), axis=0)
        else:
            nucleus = _search_threshold(logits_ptr + row * logits_stride, vocab, _order_key(lo), _order_key(hi),
                                        top, divisor, target, True, PIVOTS, SEARCH_LANES)
        tl.store(out_ptr + row, tl.maximum(tl.load(out_ptr + row), nucleus))


@triton.jit
def _filter_thresholds_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, candidates_ptr, out_ptr,
                              state_ptr, fill_ptr, above_ptr, vocab, logits_stride, RANKS: tl.constexpr,
                              TOP_P: tl.constexpr, SPLIT_NUCLEUS: tl.constexpr, LANES: tl.constexpr,
                              CAPACITY: tl.constexpr, TOP_P_RANK: tl.constexpr, PIVOTS: tl.constexpr,
                              SEARCH_LANES: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row)
    divisor = tl.where(temperature > 0.0, temperature, 1.0)
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    neg_inf = tl.full([], float("-inf"), tl.float32)
    threshold = neg_inf
    if SPLIT_NUCLEUS:
        tl.store(state_ptr + row * 4 + 2, -1.0)  # no split search unless set below
        tl.store(fill_ptr + row, 0)
        tl.store(above_ptr + row, 0.0)
    if (temperature > 0.0) & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)):
        # Pass 1: each lane's maximum, for top-p its mass (an online softmax), and for the split
        # search its smallest finite logit.
        lanes = tl.arange(0, LANES)
        lane_max = tl.full([LANES], float("-inf"), tl.float32)
        lane_mass = tl.zeros([LANES], tl.float32)
        lane_min = tl.full([LANES], float("inf"), tl.float32)
        for start in range(0, vocab, LANES):
            cols = start + lanes
            x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(lane_max, x)
            if TOP_P:
                base = tl.where(new_max > float("-inf"), new_max, 0.0)  # all -inf so far: no mass
                lane_mass = lane_mass * tl.exp((lane_max - base) / divisor) + tl.exp((x - base) / divisor)
            if SPLIT_NUCLEUS:
                lane_min = tl.minimum(lane_min, tl.where(x > float("-inf"), x, float("inf")))
            lane_max = new_max
        top = tl.max(lane_max, axis=0)
        lane_share = lane_mass * tl.exp((lane_max - top) / divisor)
        mass = tl.sum(lane_share, axis=0)
        if RANKS:
            if (top_k > 0) | (top_p < 1.0):
                # Pass 2: the candidates, every finite logit at or above the lane maxima's
                # rank-th largest (rank > LANES: every finite logit).
                rank = tl.where(top_k > 0, top_k, TOP_P_RANK)
                ranked = tl.sort(lane_max, descending=True)
                bound = tl.max(tl.where(lanes == rank - 1, ranked, float("-inf")), axis=0)
                candidates_hold = True
                if SPLIT_NUCLEUS:
                    # A nucleus alone that the lanes holding the candidates cannot fill lies below
                    # them (a flat row): the split search finds it, from just below the row's
                    # smallest finite logit up to its largest.
                    candidates_hold = (top_k > 0) | (top_p == 1.0) | (
                        tl.sum(tl.where(lane_max >= bound, lane_share, 0.0), axis=0) >= top_p * mass)
                    if candidates_hold == 0:
                        lowest = tl.min(lane_min, axis=0)
                        tl.store(state_ptr + row * 4, _key_value(_order_key(lowest).to(tl.int64) - 1))
                        tl.store(state_ptr + row * 4 + 1, top)
                        tl.store(state_ptr + row * 4 + 2, top_p * mass)
                        tl.store(state_ptr + row * 4 + 3, top)
                if candidates_hold:
                    count = 0
                    for start in range(0, vocab, LANES):
                        cols = start + lanes
                        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                        take = ((x >= bound) & (x > float("-inf"))).to(tl.int32)
                        taken = tl.sum(take, axis=0)
                        if taken > 0:  # most tiles hold none: skip the scan
                            slot = count + tl.cumsum(take, axis=0) - 1
                            tl.store(candidates_ptr + row * CAPACITY + slot, x, mask=(take > 0) & (slot < CAPACITY))
                            count += taken
                    tl.debug_barrier()  # the candidates are read back by other threads of the program
                    if count <= CAPACITY:
                        slots = tl.arange(0, CAPACITY)
                        values = tl.load(candidates_ptr + row * CAPACITY + slots, mask=slots < count,
                                         other=float("-inf"))
                        values = tl.sort(values, descending=True)
                        # The k-th largest (-inf when fewer than k logits are finite).
                        threshold = tl.max(tl.where(slots == top_k - 1, values, float("-inf")), axis=0)
                        if TOP_P:
                            if top_p < 1.0:
                                probs = tl.exp((values - top) / divisor)
                                # The nucleus of what the top-k keeps: its mass, renormalized.
                                if top_k > 0:
                                    mass = tl.sum(tl.where(values >= threshold, probs, 0.0), axis=0)
                                kept = tl.sum(((tl.cumsum(probs, axis=0) - probs) < top_p * mass).to(tl.int32),
                                              axis=0)
                                kept = tl.maximum(kept, 1)
                                # The nucleus lies among the candidates unless all of them are
                                # kept and finite logits below them remain; a top-k bounds it anyway.
                                if (top_k > 0) | (kept < count) | (bound == float("-inf")):
                                    nucleus = tl.max(tl.where(slots == kept - 1, values, float("-inf")), axis=0)
                                else:
                                    lowest = tl.max(tl.where(slots == count - 1, values, float("-inf")), axis=0)
                                    nucleus = _search_threshold(row_ptr, vocab, _order_key(neg_inf),
                                                                _order_key(lowest), top, divisor, top_p * mass,
                                                                True, PIVOTS, SEARCH_LANES)
                                threshold = tl.maximum(threshold, nucleus)
                    else:
                        # Too many candidates (many logits near the k-th, or k > LANES): exact searches.
                        if top_k > 0:
                            if count >= top_k:
                                lo = tl.where(bound > float("-inf"), _order_key(bound) - 1, _order_key(bound))
                                threshold = _search_threshold(row_ptr, vocab, lo, _order_key(top), top, divisor,
                                                              top_k.to(tl.float32), False, PIVOTS, SEARCH_LANES)
                        if TOP_P:
                            if top_p < 1.0:
                                if top_k > 0:  # the nucleus of what the top-k keeps: its mass
                                    lane_kept = tl.zeros([LANES], tl.float32)
                                    for start in range(0, vocab, LANES):
                                        cols = start + lanes
                                        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
                                        x = x.to(tl.float32)
                                        lane_kept += tl.where(x >= threshold, tl.exp((x - top) / divisor), 0.0)
                                    mass = tl.sum(lane_kept, axis=0)
                                nucleus = _search_threshold(row_ptr, vocab, _order_key(neg_inf), _order_key(top),
                                                            top, divisor, top_p * mass, True, PIVOTS, SEARCH_LANES)
                                threshold = tl.maximum(threshold, nucleus)
        if min_p > 0.0:
            threshold = tl.maximum(threshold, top + divisor * tl.log(min_p))
    tl.store(out_ptr + row, threshold)


def filter_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor, needed: int, any_top_p: bool) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if not rows:
        return out
    temperature = temperature.contiguous()
    candidates = torch.empty((rows, FILTER_CAPACITY) if needed else (1,), dtype=torch.float32, device=logits.device)
    # Some row's nucleus may stand alone (``needed`` is the vocabulary): its flat rows are searched
    # by programs over column ranges, after this kernel. Per row: lo, hi, target mass and top
    # logit of the search; how many logits lie in its bracket, and the mass above it.
    split_nucleus = any_top_p and needed >= vocab
    state = torch.empty((rows, 4) if split_nucleus else (1,), dtype=torch.float32, device=logits.device)
    fill = torch.empty(rows if split_nucleus else 1, dtype=torch.int32, device=logits.device)
    above = torch.empty(rows if split_nucleus else 1, dtype=torch.float32, device=logits.device)
    _filter_thresholds_kernel[(rows,)](
        logits, temperature, top_k.contiguous(), top_p.contiguous(), min_p.contiguous(), candidates, out, state,
        fill, above, vocab, logits.stride(0), RANKS=needed > 0, TOP_P=any_top_p, SPLIT_NUCLEUS=split_nucleus,
        LANES=FILTER_LANES, CAPACITY=FILTER_CAPACITY, TOP_P_RANK=FILTER_TOP_P_RANK, PIVOTS=FILTER_PIVOTS,
        SEARCH_LANES=FILTER_SEARCH_LANES, num_warps=FILTER_WARPS)
    if split_nucleus:
        _split_nucleus_search(logits, temperature, state, fill, above, candidates, out)
    return out


def _split_nucleus_search(logits: torch.Tensor, temperature: torch.Tensor, state: torch.Tensor, fill: torch.Tensor,
                          above: torch.Tensor, scratch: torch.Tensor, out: torch.Tensor) -> None:
    """The nucleus of the rows the filter kernel left searching, folded into ``out``. Every
    launch is made whatever the rows need (no sync): a row that does not search returns at once."""
    rows, vocab = logits.shape
    blocks = triton.cdiv(vocab, NUCLEUS_LANES)
    # Like the sampling kernel's: column ranges until the SMs are full; variants depend only on
    # the vocabulary.
    splits = max(1, min(blocks, NUCLEUS_PROGRAMS_PER_SM * num_sms(logits.device) // rows))
    split_len = triton.cdiv(blocks, splits) * NUCLEUS_LANES
    splits = triton.cdiv(vocab, split_len)
    partial = torch.empty((rows, splits, NUCLEUS_PIVOTS), dtype=torch.float32, device=logits.device)
    for _ in range(NUCLEUS_ROUNDS):
        _nucleus_round_kernel[(rows, splits)](logits, temperature, state, partial, vocab, logits.stride(0), split_len,
                                              splits, PIVOTS=NUCLEUS_PIVOTS, LANES=NUCLEUS_LANES,
                                              num_warps=NUCLEUS_WARPS)
        _nucleus_update_kernel[(rows,)](state, partial, splits, PIVOTS=NUCLEUS_PIVOTS,
                                        BLOCK_S=triton.next_power_of_2(blocks))
    _nucleus_gather_kernel[(rows, splits)](logits, temperature, state, fill, scratch, above, vocab, logits.stride(0),
                                           split_len, CAPACITY=FILTER_CAPACITY, LANES=NUCLEUS_LANES,
                                           num_warps=NUCLEUS_WARPS)
    _nucleus_finish_kernel[(rows,)](logits, temperature, state, fill, scratch, above, out, vocab, logits.stride(0),
                                    CAPACITY=FILTER_CAPACITY, PIVOTS=FILTER_PIVOTS, SEARCH_LANES=FILTER_SEARCH_LANES,
                                    num_warps=FILTER_WARPS)


TOKEN_LOGPROBS_LANES = 2048
# The top-n come from the logits at or above the n-th largest lane maximum, sorted in registers:
# up to this many per row (more, or a row with fewer finite lane maxima: an exact search first).
TOKEN_LOGPROBS_CAPACITY = 128


@triton.jit
def _pack_logit(x, cols):
    # A logit and its column in one int64 whose order is the logit's, then the lower column first.
    return (_order_key(x).to(tl.int64) << 32) + (0xFFFFFFFF - cols.to(tl.int64))


@triton.jit(do_not_specialize=["num_top"])  # one variant for every n
def _token_logprobs_kernel(logits_ptr, token_ids_ptr, logprob_ptr, rank_ptr, top_values_ptr, top_ids_ptr,
                           scratch_ptr, vocab, logits_stride, num_top, LANES: tl.constexpr, CAPACITY: tl.constexpr,
                           PIVOTS: tl.constexpr, SEARCH_LANES: tl.constexpr):
    # Pass 1: each lane's running maximum and softmax mass (an online softmax), how many of its
    # logits exceed the chosen token's, and how many are finite.
    row = tl.program_id(0)
    row_ptr = logits_ptr + row * logits_stride
    chosen = tl.load(row_ptr + tl.load(token_ids_ptr + row)).to(tl.float32)
    lanes = tl.arange(0, LANES)
    lane_max = tl.full([LANES], float("-inf"), tl.float32)
    lane_mass = tl.zeros([LANES], tl.float32)
    lane_above = tl.zeros([LANES], tl.int32)
    lane_finite = tl.zeros([LANES], tl.int32)
    for start in range(0, vocab, LANES):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        base = tl.where(new_max > float("-inf"), new_max, 0.0)  # all -inf so far: no mass
        lane_mass = lane_mass * tl.exp(lane_max - base) + tl.exp(x - base)
        lane_max = new_max
        lane_above += (x > chosen).to(tl.int32)
        lane_finite += (x > float("-inf")).to(tl.int32)
    top = tl.max(lane_max, axis=0)
    log_total = top + tl.log(tl.sum(lane_mass * tl.exp(lane_max - top), axis=0))
    tl.store(logprob_ptr + row, chosen - log_total)
    tl.store(rank_ptr + row, tl.sum(lane_above, axis=0).to(tl.int64) + 1)
    if num_top > 0:
        # Pass 2: the candidates, every logit at or above the n-th largest lane maximum (n distinct
        # logits are, so the top n are among them), packed with their columns.
        scratch = scratch_ptr + row * CAPACITY
        bound = tl.max(tl.where(lanes == num_top - 1, tl.sort(lane_max, descending=True), float("-inf")), axis=0)
        count = tl.where(bound > float("-inf"), 0, CAPACITY + 1)
        if bound > float("-inf"):
            for start in range(0, vocab, LANES):
                cols = start + lanes
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                take = (x >= bound).to(tl.int32)
                taken = tl.sum(take, axis=0)
                if taken > 0:  # most tiles hold none: skip the scan
                    slot = count + tl.cumsum(take, axis=0) - 1
                    tl.store(scratch + slot, _pack_logit(x, cols), mask=(take > 0) & (slot < CAPACITY))
                    count += taken
        if count > CAPACITY:
            # Too many ties at the bound, or fewer than n finite lane maxima: the n-th largest
            # logit t exactly, then the logits above t and the first of those equal to it.
            threshold = tl.full([], float("-inf"), tl.float32)
            if tl.sum(lane_finite, axis=0) >= num_top:
                threshold = _search_threshold(row_ptr, vocab, _order_key(threshold), _order_key(top), top, 1.0,
                                              num_top.to(tl.float32), False, PIVOTS, SEARCH_LANES)
            count = 0
            for start in range(0, vocab, LANES):
                cols = start + lanes
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                take = (x > threshold).to(tl.int32)
                slot = count + tl.cumsum(take, axis=0) - 1
                tl.store(scratch + slot, _pack_logit(x, cols), mask=(take > 0) & (slot < CAPACITY))
                count += tl.sum(take, axis=0)
            for start in range(0, vocab, LANES):
                cols = start + lanes
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                take = ((x == threshold) & (cols < vocab)).to(tl.int32)
                slot = count + tl.cumsum(take, axis=0) - 1
                tl.store(scratch + slot, _pack_logit(x, cols), mask=(take > 0) & (slot < num_top))
                count += tl.sum(take, axis=0)
            count = tl.minimum(count, num_top)
        tl.debug_barrier()  # the candidates are read back by other threads of the program
        slots = tl.arange(0, CAPACITY)
        packed = tl.sort(tl.load(scratch + slots, mask=slots < count, other=-(2**63)), descending=True)
        values = _key_value((packed >> 32).to(tl.int32))
        ids = 0xFFFFFFFF - (packed & 0xFFFFFFFF)
        tl.store(top_values_ptr + row * num_top + slots, values - log_total, mask=slots < num_top)
        tl.store(top_ids_ptr + row * num_top + slots, ids, mask=slots < num_top)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The chosen tokens' logprobs and ranks, and the top ones, in one program per row (no
    # log_softmax of the row is written, no sort of it).
    rows, vocab = logits.shape
    if num_top > vocab:
        raise ValueError(f"{num_top} top logprobs asked of a vocabulary of {vocab}")
    capacity = max(TOKEN_LOGPROBS_CAPACITY, triton.next_power_of_2(num_top))
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    rank = torch.empty(rows, dtype=torch.long, device=logits.device)
    # (At least one column each: the kernel gets a valid pointer when no top ones are asked.)
    top_values = torch.empty(rows, max(num_top, 1), dtype=torch.float32, device=logits.device)
    top_ids = torch.empty(rows, max(num_top, 1), dtype=torch.long, device=logits.device)
    scratch = torch.empty(rows if num_top else 1, capacity, dtype=torch.int64, device=logits.device)
    if rows:
        _token_logprobs_kernel[(rows,)](logits, token_ids, logprob, rank, top_values, top_ids, scratch, vocab,
                                        logits.stride(0), num_top, LANES=TOKEN_LOGPROBS_LANES, CAPACITY=capacity,
                                        PIVOTS=FILTER_PIVOTS, SEARCH_LANES=FILTER_SEARCH_LANES, num_warps=8)
    return logprob, rank, top_values[:, :num_top], top_ids[:, :num_top]


@triton.jit
def _apply_penalties_kernel(logits_ptr, rows_ptr, slots_ptr, bias_ptr, counts_ptr, prompt_mask_ptr, penalties_ptr,
                            vocab, logits_stride, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i)
    table = slot * vocab + cols
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_vocab) + tl.load(bias_ptr + table, mask=in_vocab)
    count = tl.load(counts_ptr + table, mask=in_vocab, other=0)
    presence = tl.load(penalties_ptr + slot * 3)
    frequency = tl.load(penalties_ptr + slot * 3 + 1)
    repetition = tl.load(penalties_ptr + slot * 3 + 2)
    seen = (tl.load(prompt_mask_ptr + table, mask=in_vocab, other=0) != 0) | (count > 0)
    x = tl.where(seen, tl.where(x > 0, x / repetition, x * repetition), x)
    x -= frequency * count.to(tl.float32) + presence * (count > 0).to(tl.float32)
    tl.store(logits_ptr + row * logits_stride + cols, x, mask=in_vocab)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, bias: torch.Tensor,
                    counts: torch.Tensor, prompt_mask: torch.Tensor, penalties: torch.Tensor) -> None:
    vocab = logits.shape[1]
    block = min(1024, triton.next_power_of_2(vocab))
    if rows.numel():
        _apply_penalties_kernel[(rows.numel(), triton.cdiv(vocab, block))](
            logits, rows, slots, bias, counts, prompt_mask.view(torch.uint8), penalties, vocab, logits.stride(0),
            BLOCK=block)


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words, logits_stride, BLOCK: tl.constexpr):
    k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + k)
    in_vocab = cols < vocab
    # Columns past the mask's width read word 0 (other=0): refused.
    word = tl.load(bitmask_ptr + k * words + cols // 32, mask=in_vocab & (cols < 32 * words), other=0)
    refused = ((word >> (cols % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=in_vocab & refused)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    vocab, (masks, words) = logits.shape[1], bitmask.shape
    block = min(1024, triton.next_power_of_2(vocab))
    if masks:
        _apply_token_bitmask_kernel[(masks, triton.cdiv(vocab, block))](
            logits, bitmask.contiguous(), rows, vocab, words, logits.stride(0), BLOCK=block)
