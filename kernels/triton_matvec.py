"""``y = x W^T + b`` for one row of ``x``: the matrix-vector product of a batch-1 decode step.

At one row a matmul only streams the weight matrix from HBM; cuBLAS's kernels for it reach
about 73% of the H200's bandwidth on a 1B model's matrices. Here each program owns
``MATVEC_ROWS`` rows of ``W`` (outputs) and walks the input dimension in ``MATVEC_COLS``-wide
tiles, accumulating in float32, so every weight byte is read once with wide loads from many
programs at a time. Twin of :func:`hookllm.kernels.reference.matvec`, the same signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MATVEC_ROWS = 8  # weight rows (outputs) per program
MATVEC_COLS = 512  # input columns per tile
MATVEC_WARPS = 4


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, n, k, w_stride, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                   COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < n
    cols = tl.arange(0, COLS)
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for start in range(0, k, COLS):
        c = start + cols
        x = tl.load(x_ptr + c, mask=c < k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * w_stride + c[None, :],
                    mask=in_rows[:, None] & (c[None, :] < k), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=in_rows)


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[1, K]`` (or ``[K]``) times ``weight`` ``[N, K]`` transposed, plus ``bias``: ``[1, N]``."""
    k = x.shape[-1]
    n = weight.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    _matvec_kernel[(triton.cdiv(n, MATVEC_ROWS),)](
        x.contiguous(), weight, weight if bias is None else bias, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, ROWS=MATVEC_ROWS, COLS=MATVEC_COLS, num_warps=MATVEC_WARPS)
    return out
