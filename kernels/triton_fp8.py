"""Triton kernels of the FP8 linear layers: ``quantize_fp8`` and ``scaled_matmul``.

Same signatures and semantics as their twins in :mod:`hookllm.kernels.reference`.

* ``quantize_fp8``: one program per (row, group) finds the group's absolute maximum, writes the
  scale and the saturated e4m3 values in one pass over the activations.
* ``scaled_matmul``: a tiled GEMM of ``[M, K]`` activations by ``[N, K]`` e4m3 weights. With e4m3
  activations (W8A8, Hopper and Ada) both tiles feed the FP8 tensor cores as loaded; with
  model-dtype activations (weight-only, for GPUs without FP8 tensor cores) each weight tile is
  converted in registers. Per-token / per-channel scales (one group) multiply the accumulator
  once at the end; group scales (block-quantized weights, ``BLOCK_K`` dividing the group) each
  K step's partial product.
* Split-K for decode-sized batches: a few rows give too few output tiles to keep the SMs'
  loads in flight, so each tile's K steps are cut into ``split_k`` ranges whose programs write
  float32 partial sums; a second kernel adds them up (bias included) in the output dtype.

Launch configurations are keyed by the row count; the split by how many programs the output
tiles leave the GPU. Per-token x per-channel W8A8 goes to cuBLASLt instead (``scaled_matmul``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hookllm.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from hookllm.kernels.triton_attention import num_sms

_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, columns, x_stride, q_stride, groups,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (cols < columns) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / _MAX, _MIN_SCALE)
    tl.store(scale_ptr + row * groups + group, scale)
    q = tl.clamp(x / scale, -_MAX, _MAX)
    tl.store(q_ptr + row * q_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (``group_size = K``) or per-group e4m3 quantization of ``x`` ``[M, K]``."""
    rows, columns = x.shape
    groups = triton.cdiv(columns, group_size)
    q = torch.empty((rows, columns), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(group_size)
    if rows:
        _quantize_kernel[(rows, groups)](x, q, scale, columns, x.stride(0), q.stride(0), groups,
                                         GROUP=group_size, BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    return q, scale


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


# (most rows, config), smallest first: the best of a sweep on an H200 over the Llama-3.1-8B
# layers (benchmarks/fp8.py --sweep); past CUBLAS_FROM_ROWS cuBLASLt is faster (scaled_matmul).
_CONFIGS_BY_ROWS = (
    (16, MatmulConfig(16, 32, 128, 4, 5)),
    (64, MatmulConfig(64, 64, 128, 4, 5)),
    (float("inf"), MatmulConfig(128, 64, 128, 8, 4)),
)
CUBLAS_FROM_ROWS = 65
# Split-K: double the split while the programs stay within this many per SM and each split keeps
# MIN_SPLIT_STEPS K steps (the summing kernel costs about what a short split saves). On an H200
# (benchmarks/fp8.py --split-sweep, Llama 1B and 8B layers at 1 to 64 rows) this picks the best
# split or one within 0.5 us of it.
SPLIT_PROGRAMS_PER_SM = 4
MIN_SPLIT_STEPS = 16
MAX_SPLIT_K = 16


def default_config(rows: int, outputs: int = 0, columns: int = 0, sm_count: int = 0) -> MatmulConfig:
    """The launch configuration of ``rows`` x ``columns`` activations by ``outputs`` x ``columns``
    weights on a GPU of ``sm_count`` SMs (0: no split)."""
    config = next(config for bound, config in _CONFIGS_BY_ROWS if rows <= bound)
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(outputs, config.block_n)
    if not sm_count or not tiles:
        return config
    split = 1
    while (split * 2 <= MAX_SPLIT_K and tiles * split * 2 <= SPLIT_PROGRAMS_PER_SM * sm_count
           and columns // (split * 2 * config.block_k) >= MIN_SPLIT_STEPS):
        split *= 2
    return dataclasses.replace(config, split_k=split)


@triton.jit
def _scaled_matmul_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_asg, stride_bn, stride_bk, stride_bsn, stride_bsg,
    stride_om, stride_on,
    GROUP_K: tl.constexpr, A_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid: (output tiles, K splits), tiles grouped by GROUP_M row tiles so neighbouring programs
    share weight tiles in L2. GROUP_K = 0: one scale group (applied after the K loop). With SPLIT
    the program's float32 partial sum goes to ``out[split]`` (``[splits, M, N]``), unbiased."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    split_steps = tl.cdiv(steps, tl.num_programs(1))
    first_step = tl.program_id(1) * split_steps
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + (first_step * BLOCK_K + rk)[None, :] * stride_ak
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + (first_step * BLOCK_K + rk)[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(first_step, tl.minimum(first_step + split_steps, steps)):
        k_ok = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if A_SCALED:
            part = tl.dot(a, b)
        else:
            part = tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
        if GROUP_K > 0:
            g = k * BLOCK_K // GROUP_K
            scale = tl.load(b_scale_ptr + rn * stride_bsn + g * stride_bsg, mask=n_ok, other=0.0)[None, :]
            if A_SCALED:
                scale = scale * tl.load(a_scale_ptr + rm * stride_asm + g * stride_asg, mask=m_ok, other=0.0)[:, None]
            acc += part * scale
        else:
            acc += part
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GROUP_K == 0:
        acc *= tl.load(b_scale_ptr + rn * stride_bsn, mask=n_ok, other=0.0)[None, :]
        if A_SCALED:
            acc *= tl.load(a_scale_ptr + rm * stride_asm, mask=m_ok, other=0.0)[:, None]
    if SPLIT:
        out_ptr += tl.program_id(1).to(tl.int64) * M * N
    elif HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, splits, stride_om, stride_on,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid: (rows, column blocks). ``out = sum(part[:, m, n]) + bias`` in the output dtype."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(splits):
        acc += tl.load(part_ptr + (split * M + m) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols * stride_on, acc.to(out_ptr.dtype.element_ty), mask=ok)


def scaled_matmul_with(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None, config: MatmulConfig) -> torch.Tensor:
    """``scaled_matmul`` with an explicit launch configuration (tests, tuning)."""
    rows, columns = a.shape
    outputs = b.shape[0]
    groups = b_scale.shape[1]
    group_k = 0 if groups == 1 else triton.cdiv(columns, groups)
    if a_scale is not None and a_scale.shape[1] not in (1, groups):
        raise ValueError(f"activation scales have {a_scale.shape[1]} groups, the weight's {groups}")
    if a_scale is not None and groups > 1 and a_scale.shape[1] == 1:
        a_scale = a_scale.expand(rows, groups)  # one activation scale per row, read per group
    block_k = config.block_k if not group_k else min(config.block_k, group_k)
    if group_k and group_k % block_k:
        raise ValueError(f"scale groups of {group_k} columns are not a multiple of BLOCK_K={block_k}")
    out = torch.empty((rows, outputs), dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    split = config.split_k > 1
    target = torch.empty((config.split_k, rows, outputs), dtype=torch.float32, device=a.device) if split else out
    scale_a = b_scale if a_scale is None else a_scale  # unused without A_SCALED
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(outputs, config.block_n), config.split_k)
    _scaled_matmul_kernel[grid](
        a, scale_a, b, b_scale, bias, target, rows, outputs, columns,
        *a.stride(), *scale_a.stride(), *b.stride(), *b_scale.stride(), *target.stride()[-2:],
        GROUP_K=group_k, A_SCALED=a_scale is not None, HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT=split,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split:
        block = 1024
        _sum_splits_kernel[(rows, triton.cdiv(outputs, block))](
            target, bias, out, rows, outputs, config.split_k, *out.stride(), HAS_BIAS=bias is not None, BLOCK=block,
            num_warps=4)
    return out


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T + bias``: see :func:`hookllm.kernels.reference.scaled_matmul`.

    W8A8 with one scale per row and per output channel, from ``CUBLAS_FROM_ROWS`` rows on, runs on
    cuBLASLt (``torch._scaled_mm``), which beat this module's kernel there on the H200 while the
    kernel beat it below (benchmarks/fp8.py, docs/performance.md); group scales and weight-only
    always run the Triton kernel."""
    if a_scale is not None and a.shape[0] >= CUBLAS_FROM_ROWS and b_scale.shape[1] == 1 == a_scale.shape[1] \
            and b.shape[0] % 16 == 0 == b.shape[1] % 16 and (bias is None or bias.dtype == out_dtype):
        return torch._scaled_mm(a, b.t(), scale_a=a_scale.contiguous(), scale_b=b_scale.reshape(1, -1),
                                bias=bias, out_dtype=out_dtype)
    config = default_config(a.shape[0], b.shape[0], a.shape[1], num_sms(a.device) if a.is_cuda else 0)
    return scaled_matmul_with(a, a_scale, b, b_scale, out_dtype, bias, config)
