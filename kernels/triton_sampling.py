"""Triton kernel for the last step of sampling: ``sample_with_noise``.

Same signature and semantics as :func:`hookllm.kernels.reference.sample_with_noise`. One
program per row streams the row's logits (any float dtype) and noise once, keeping a running
best score per lane, instead of the five full passes (scale, softmax, divide, argmax) the
torch version makes over a ``[rows, vocab]`` float32 tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _sample_with_noise_kernel(logits_ptr, noise_ptr, temperature_ptr, out_ptr, vocab, logits_stride,
                              noise_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    sampled = temperature > 0.0
    divisor = tl.where(sampled, temperature, 1.0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    noise_end = tl.where(sampled, vocab, 0)  # greedy rows never read their noise
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < vocab
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        q = tl.load(noise_ptr + row * noise_stride + cols, mask=cols < noise_end, other=1.0)
        score = tl.where(sampled, x / divisor - tl.log(q), x)
        better = score > best  # strict: each lane keeps its first column among equals
        best = tl.where(better, score, best)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best, axis=0)
    # The first column holding the top score, as torch.argmax picks it.
    col = tl.min(tl.where(best == top, best_col, vocab), axis=0)
    tl.store(out_ptr + row, tl.minimum(col, vocab - 1).to(tl.int64))


def sample_with_noise(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows:
        _sample_with_noise_kernel[(rows,)](logits, noise, temperature, out, vocab, logits.stride(0), noise.stride(0),
                                           BLOCK=min(BLOCK, triton.next_power_of_2(vocab)))
    return out
