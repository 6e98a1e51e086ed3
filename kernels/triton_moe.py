"""Triton kernels of the fused mixture-of-experts layer.

``fused_moe``, ``route`` and ``moe_align`` have the signatures and semantics of their twins in
:mod:`hookllm.kernels.reference`. The routing (softmax, top-k, renormalisation) is one launch
instead of the reference's five; the alignment three kernels and a fill instead of about
eighteen torch ops: under a CUDA graph each launch still costs the GPU a few microseconds, and
a layer of Qwen3-30B-A3B spent more on this glue than on one of its GEMMs at batch 256.

The (token, slot) pairs are sorted by expert and each expert's run padded to whole blocks of
``block_m`` rows (``moe_align``), so that each program of a grouped GEMM multiplies rows of
one expert by that expert's weight tile, and the whole batch is two launches whatever the
routing, instead of the reference's two matmuls per expert:

1. gate/up: rows of ``hidden`` (gathered by pair) times the expert's gate and up tiles, the
   gated activation (biases and gpt-oss's clamp included) applied in registers, written to an
   intermediate ``[pairs, inter]``;
2. down: intermediate rows times the expert's down tile, plus bias, times the pair's routing
   weight, written to ``[pairs, hidden]``; each token's ``top_k`` rows are then summed.

e4m3 expert weights (weight-only FP8, ``gate_up_scale`` / ``down_scale``) are converted tile by
tile in registers; one scale per output row multiplies the accumulator after the K loop, group
scales (block-quantized checkpoints, ``BLOCK_K`` dividing the group) each K step's product.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from hookllm.kernels.reference import SWIGLU_OAI_ALPHA, check_moe_activation
from hookllm.kernels.triton_attention import _dot_dtype

__all__ = ["MoeConfig", "default_config", "fused_moe", "fused_moe_with", "moe_align", "route"]

_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)  # kernels read globals only as constexpr


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of both grouped GEMMs."""

    block_m: int  # pair rows per program (and moe_align's padding unit)
    block_n: int  # output columns per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


# (most pairs per expert, config), smallest first; past the last bound the last config applies.
# Tuned on an H200 in bf16 (benchmarks/moe.py --sweep; docs/performance.md): the rows each
# expert gets on average (tokens * top_k / experts), not the token count, decide the row block.
# Within 5% of the best of 15 candidates at every measured size of Qwen3-30B-A3B, gpt-oss-20b
# and Mixtral-8x7B. Two weight tiles per stage (gate and up) bound the tile sizes.
_CONFIGS_BY_PAIRS_PER_EXPERT = (
    (8, MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (16, MoeConfig(block_m=32, block_n=128, block_k=128, num_warps=8, num_stages=3)),
    (64, MoeConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    (float("inf"), MoeConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)


def default_config(num_tokens: int, top_k: int, num_experts: int, element_size: int = 2) -> MoeConfig:
    """The block sizes for ``num_tokens`` tokens routed to ``top_k`` of ``num_experts`` experts,
    of ``element_size``-byte inputs: wider elements take a shorter reduction step, so that a
    stage's tiles need the shared memory they need in bf16 (the tuned tables' dtype)."""
    pairs_per_expert = num_tokens * top_k / num_experts
    config = next(config for bound, config in _CONFIGS_BY_PAIRS_PER_EXPERT if pairs_per_expert <= bound)
    if element_size <= 2:
        return config
    return dataclasses.replace(config, block_k=max(16, config.block_k * 2 // element_size))


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, logits_stride, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, OVER_ALL: tl.constexpr):
    """One token: its ``TOP_K`` largest logits, best first (ties to the lower expert), and their
    weights ``exp(logit - max)`` over the sum of all experts' (OVER_ALL) or of the top k's."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * logits_stride + experts, mask=experts < num_experts,
                     other=float("-inf")).to(tl.float32)
    top = tl.max(logits, 0)
    total = tl.sum(tl.exp(logits - top), 0)
    slots = tl.arange(0, BLOCK_K)
    top_values = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    remaining = logits
    for slot in tl.static_range(TOP_K):
        best = tl.max(remaining, 0)
        expert = tl.min(tl.where(remaining == best, experts, BLOCK_E), 0)
        top_values = tl.where(slots == slot, tl.exp(best - top), top_values)
        top_ids = tl.where(slots == slot, expert, top_ids)
        remaining = tl.where(experts == expert, float("-inf"), remaining)
    divisor = total if OVER_ALL else tl.sum(top_values, 0)
    in_top = slots < TOP_K
    tl.store(weights_ptr + token * TOP_K + slots, top_values / divisor, mask=in_top)
    tl.store(ids_ptr + token * TOP_K + slots, top_ids, mask=in_top)


def route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool,
          softmax_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``route`` in one launch. A softmax over the top k logits equals the top k
    of the softmax renormalised (both are ``exp(l - max)`` over the top k's sum), so the two
    orders share the kernel: only softmax-first without renormalisation divides by every expert's."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                 BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
                                 OVER_ALL=softmax_first and not renormalize)
    return weights, ids


# Pairs per program of the alignment's counting and placing kernels: a program compares its
# pairs with every expert (counting) and with each other (ranking), CHUNK x experts and CHUNK^2.
_ALIGN_CHUNK = 64


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, pairs, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk ``c``'s pairs per expert (the absent id ``num_experts`` included): ``counts[c]``."""
    chunk = tl.program_id(0)
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + pair, mask=pair < pairs, other=BLOCK_E)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + chunk * BLOCK_E + experts, counts)


@triton.jit
def _align_offsets_kernel(counts_ptr, offsets_ptr, expert_of_block_ptr, num_padded_ptr, chunks, num_experts,
                          num_blocks, block_m, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: each expert's run starts where the padded runs before it end; chunk ``c``'s
    pairs of an expert start after the earlier chunks' (``offsets[c]``), so each run keeps the
    pairs' order. Also each block's expert and the padded total."""
    experts = tl.arange(0, BLOCK_E)
    is_expert = experts < num_experts
    totals = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for chunk in range(chunks):
        totals += tl.load(counts_ptr + chunk * BLOCK_E + experts)
    padded = tl.where(is_expert, (totals + block_m - 1) // block_m * block_m, 0)
    ends = tl.cumsum(padded, 0)
    running = ends - padded
    for chunk in range(chunks):
        tl.store(offsets_ptr + chunk * BLOCK_E + experts, running)
        running += tl.load(counts_ptr + chunk * BLOCK_E + experts)
    tl.store(num_padded_ptr, tl.max(ends, 0))
    # Block b's expert: how many runs end at or before its first row (num_experts past the end).
    for first in range(0, num_blocks, BLOCK_B):
        blocks = first + tl.arange(0, BLOCK_B)
        ended = (ends[None, :] <= (blocks * block_m)[:, None]) & is_expert[None, :]
        tl.store(expert_of_block_ptr + blocks, tl.sum(ended.to(tl.int32), 1), mask=blocks < num_blocks)


@triton.jit
def _align_place_kernel(ids_ptr, offsets_ptr, sorted_ptr, pairs, num_experts, BLOCK_E: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Chunk ``c``'s pairs into their runs: after the chunk's offset of their expert, in order."""
    chunk = tl.program_id(0)
    index = tl.arange(0, CHUNK)
    pair = chunk * CHUNK + index
    is_pair = pair < pairs
    expert = tl.load(ids_ptr + pair, mask=is_pair, other=BLOCK_E)
    # Each pair's rank among the chunk's earlier pairs of its expert.
    earlier = (expert[None, :] == expert[:, None]) & (index[None, :] < index[:, None])
    rank = tl.sum(earlier.to(tl.int32), 1)
    present = is_pair & (expert < num_experts)
    start = tl.load(offsets_ptr + chunk * BLOCK_E + expert, mask=present, other=0)
    tl.store(sorted_ptr + start + rank, pair.to(tl.int32), mask=present)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's ``moe_align``: the same outputs, entry for entry."""
    flat = topk_ids.flatten()
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    pairs, device = flat.numel(), flat.device
    max_padded = pairs + num_experts * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    chunks = max(triton.cdiv(pairs, _ALIGN_CHUNK), 1)
    block_e = triton.next_power_of_2(num_experts + 1)  # one more bin: the absent pairs
    counts = torch.empty((chunks, block_e), dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    sorted_ids = torch.full((max_padded,), pairs, dtype=torch.int32, device=device)
    expert_of_block = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _align_count_kernel[(chunks,)](flat, counts, pairs, BLOCK_E=block_e, CHUNK=_ALIGN_CHUNK)
    _align_offsets_kernel[(1,)](counts, offsets, expert_of_block, num_padded, chunks, num_experts, num_blocks,
                                block_m, BLOCK_E=block_e, BLOCK_B=max(16, 4096 // block_e))
    _align_place_kernel[(chunks,)](flat, offsets, sorted_ids, pairs, num_experts, BLOCK_E=block_e,
                                   CHUNK=_ALIGN_CHUNK)
    return sorted_ids, expert_of_block, num_padded


@triton.jit
def _block_rows(sorted_ids_ptr, expert_of_block_ptr, top_k, pairs, BLOCK_M: tl.constexpr):
    """This program's pairs, the tokens they read, which of them are real (not padding), and
    their expert."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    is_pair = pair < pairs
    expert = tl.load(expert_of_block_ptr + tl.program_id(0)).to(tl.int64)
    return pair, pair // top_k, is_pair, expert


@triton.jit
def _row_scale(scale_ptr, cols, is_col, group, stride_sn, stride_sg):
    """One expert's weight scales of output rows ``cols`` in K group ``group``, ``[1, BLOCK_N]``."""
    return tl.load(scale_ptr + cols * stride_sn + group * stride_sg, mask=is_col, other=0.0)[None, :]


@triton.jit
def _rows_times_weight(a_ptr, a_rows, is_row, a_stride, w_ptr, w_stride_n, w_stride_k, cols, is_col, K,
                       s_ptr, stride_sn, stride_sg, W_SCALED: tl.constexpr, GROUP_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a[a_rows] @ w[cols].T`` over ``K``, fp32 ``[BLOCK_M, BLOCK_N]``; ``w`` is one expert's
    weight, rows are output columns (``nn.Linear``'s layout); W_SCALED: times its scales ``s``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + ks[None, :], mask=is_row[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k,
                    mask=is_col[None, :] & in_k[:, None], other=0.0)
        part = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        if W_SCALED and GROUP_K > 0:
            part *= _row_scale(s_ptr, cols, is_col, k0 // GROUP_K, stride_sn, stride_sg)
        acc += part
    if W_SCALED and GROUP_K == 0:
        acc *= _row_scale(s_ptr, cols, is_col, 0, stride_sn, stride_sg)
    return acc


@triton.jit
def _gate_up_kernel(hidden_ptr, w_ptr, bias_ptr, out_ptr, sorted_ids_ptr, expert_of_block_ptr, num_padded_ptr,
                    top_k, pairs, hidden_size, inter, hidden_stride, w_stride_e, w_stride_n, w_stride_k,
                    bias_stride_e, swiglu_limit, s_ptr, stride_se, stride_sn, stride_sg,
                    SWIGLU_OAI: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    W_SCALED: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid is sized for the worst-case padding; this block holds none
    pair, token, is_pair, expert = _block_rows(sorted_ids_ptr, expert_of_block_ptr, top_k, pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < inter
    w = w_ptr + expert * w_stride_e
    s = s_ptr + expert * stride_se
    # One pass over K: each tile of the gathered rows is loaded once for both the gate and up dots.
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < hidden_size
        a = tl.load(hidden_ptr + token[:, None] * hidden_stride + ks[None, :], mask=is_pair[:, None] & in_k[None, :],
                    other=0.0).to(DOT_DTYPE)
        w_mask = is_col[None, :] & in_k[:, None]
        w_gate = tl.load(w + cols[None, :] * w_stride_n + ks[:, None] * w_stride_k, mask=w_mask, other=0.0)
        w_up = tl.load(w + (inter + cols)[None, :] * w_stride_n + ks[:, None] * w_stride_k, mask=w_mask, other=0.0)
        gate_part = tl.dot(a, w_gate.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        up_part = tl.dot(a, w_up.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        if W_SCALED and GROUP_K > 0:
            gate_part *= _row_scale(s, cols, is_col, k0 // GROUP_K, stride_sn, stride_sg)
            up_part *= _row_scale(s, inter + cols, is_col, k0 // GROUP_K, stride_sn, stride_sg)
        gate += gate_part
        up += up_part
    if W_SCALED and GROUP_K == 0:
        gate *= _row_scale(s, cols, is_col, 0, stride_sn, stride_sg)
        up *= _row_scale(s, inter + cols, is_col, 0, stride_sn, stride_sg)
    if HAS_BIAS:
        bias = bias_ptr + expert * bias_stride_e
        gate += tl.load(bias + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias + inter + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
    if SWIGLU_OAI:
        if HAS_LIMIT:
            gate = tl.minimum(gate, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        act = gate * tl.sigmoid(gate * _ALPHA) * (up + 1.0)
    else:
        act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + pair[:, None] * inter + cols[None, :], act.to(out_ptr.dtype.element_ty),
             mask=is_pair[:, None] & is_col[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, sorted_ids_ptr, expert_of_block_ptr, num_padded_ptr,
                 top_k, pairs, hidden_size, inter, w_stride_e, w_stride_n, w_stride_k, bias_stride_e,
                 s_ptr, stride_se, stride_sn, stride_sg, HAS_BIAS: tl.constexpr,
                 W_SCALED: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid is sized for the worst-case padding; this block holds none
    pair, _, is_pair, expert = _block_rows(sorted_ids_ptr, expert_of_block_ptr, top_k, pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < hidden_size
    out = _rows_times_weight(act_ptr, pair, is_pair, inter, w_ptr + expert * w_stride_e, w_stride_n, w_stride_k,
                             cols, is_col, inter, s_ptr + expert * stride_se, stride_sn, stride_sg, W_SCALED, GROUP_K,
                             BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION)
    if HAS_BIAS:
        out += tl.load(bias_ptr + expert * bias_stride_e + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
    out *= tl.load(weights_ptr + pair, mask=is_pair, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None] * hidden_size + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=is_pair[:, None] & is_col[None, :])


def _scale_args(scale: torch.Tensor | None, columns: int, block_k: int,
                placeholder: torch.Tensor) -> tuple[tuple, dict[str, Any]]:
    """A projection's scale pointer and strides, and its ``W_SCALED`` / ``GROUP_K`` flags."""
    if scale is None:
        return (placeholder, 0, 0, 0), dict(W_SCALED=False, GROUP_K=0)
    group_k = 0 if scale.shape[2] == 1 else triton.cdiv(columns, scale.shape[2])
    if group_k % block_k:
        raise ValueError(f"expert weight scale groups of {group_k} columns are not whole steps of {block_k}")
    return (scale, *scale.stride()), dict(W_SCALED=True, GROUP_K=group_k)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    experts_elsewhere: bool = False,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's ``fused_moe`` with the block sizes of ``default_config``."""
    return fused_moe_with(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation=activation,
                          gate_up_bias=gate_up_bias, down_bias=down_bias, swiglu_limit=swiglu_limit,
                          experts_elsewhere=experts_elsewhere, gate_up_scale=gate_up_scale, down_scale=down_scale,
                          config=default_config(hidden.shape[0], topk_ids.shape[1], w_down.shape[0],
                                                hidden.element_size()))


def fused_moe_with(
    hidden: torch.Tensor,  # [tokens, hidden]
    w_gate_up: torch.Tensor,  # [experts, 2 * inter, hidden], any strides
    w_down: torch.Tensor,  # [experts, hidden, inter], any strides
    topk_weights: torch.Tensor,  # [tokens, top_k] float32
    topk_ids: torch.Tensor,  # [tokens, top_k] int
    *,
    activation: str,
    gate_up_bias: torch.Tensor | None,  # [experts, 2 * inter], rows contiguous
    down_bias: torch.Tensor | None,  # [experts, hidden], rows contiguous
    swiglu_limit: float | None,
    experts_elsewhere: bool = False,
    gate_up_scale: torch.Tensor | None = None,  # [experts, 2 * inter, groups] float32: e4m3 weights
    down_scale: torch.Tensor | None = None,  # [experts, hidden, groups] float32
    config: MoeConfig,
) -> torch.Tensor:
    """``fused_moe`` with explicit block sizes."""
    check_moe_activation(activation, swiglu_limit)
    num_tokens, hidden_size = hidden.shape
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    top_k = topk_ids.shape[1]
    pairs = num_tokens * top_k
    if pairs == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()  # the kernel reads rows of contiguous columns
    sorted_ids, expert_of_block, num_padded = moe_align(topk_ids, num_experts, config.block_m)
    blocks = expert_of_block.numel()
    dots = dict(DOT_DTYPE=_dot_dtype(hidden.dtype),
                DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
                num_warps=config.num_warps, num_stages=config.num_stages)
    block_k = config.block_k
    for scale, columns in ((gate_up_scale, hidden_size), (down_scale, inter)):
        if scale is not None and scale.shape[2] > 1:
            block_k = min(block_k, triton.cdiv(columns, scale.shape[2]))
    blocks_mnk = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k)
    gate_up_scale_args, gate_up_flags = _scale_args(gate_up_scale, hidden_size, block_k, hidden)
    down_scale_args, down_flags = _scale_args(down_scale, inter, block_k, hidden)
    act = torch.empty((pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, config.block_n))](
        hidden, w_gate_up, hidden if gate_up_bias is None else gate_up_bias, act, sorted_ids, expert_of_block,
        num_padded, top_k, pairs, hidden_size, inter, hidden.stride(0), *w_gate_up.stride(),
        0 if gate_up_bias is None else gate_up_bias.stride(0), 0.0 if swiglu_limit is None else swiglu_limit,
        *gate_up_scale_args, SWIGLU_OAI=activation == "swiglu_oai", HAS_LIMIT=swiglu_limit is not None,
        HAS_BIAS=gate_up_bias is not None, **gate_up_flags, **blocks_mnk, **dots)
    # Rows of absent pairs (id == experts, see moe_align) are never written: they must read as 0.
    down = (torch.zeros if experts_elsewhere else torch.empty)((pairs, hidden_size), dtype=hidden.dtype,
                                                               device=hidden.device)
    _down_kernel[(blocks, triton.cdiv(hidden_size, config.block_n))](
        act, w_down, hidden if down_bias is None else down_bias, topk_weights.float().contiguous(), down,
        sorted_ids, expert_of_block, num_padded, top_k, pairs, hidden_size, inter, *w_down.stride(),
        0 if down_bias is None else down_bias.stride(0), *down_scale_args,
        HAS_BIAS=down_bias is not None, **down_flags, **blocks_mnk, **dots)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)
