"""The default sampler: greedy, temperature, top-k, top-p and min-p, batched over requests.

Every row is sampled the same way (exponential-race sampling: ``argmax(probs / q)`` with
``q ~ Exp(1)``, which draws from ``probs``), in one pass over the logits on CUDA
(``sample_with_noise`` in :mod:`hookllm.kernels`); the only per-request Python work is drawing ``q``
for requests that carry their own seed, from their own generator.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hookllm.kernels import ops_for
from hookllm.utils import to_device_async
from hookllm.batch import RequestState


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus top-p and min-p sets.

    ``top_k`` <= 0 disables top-k for that row; ``top_p`` = 1 and ``min_p`` = 0 disable theirs.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= k[:, None]
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove |= sorted_probs < (min_p[:, None] * sorted_probs[:, :1])
    remove[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, requests: Sequence[RequestState], generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``logits`` for the matching request in ``requests``."""
    # One host table and one copy for the whole batch: temperature, top_k, top_p, min_p.
    params = torch.tensor(
        [(p.temperature, p.top_k, p.top_p, p.min_p) for p in (r.sampling_params for r in requests)],
        dtype=torch.float32,
    )
    if bool((params[:, 0] == 0.0).all()):
        return logits.argmax(dim=-1)
    needs_filter = bool(((params[:, 1] > 0) | (params[:, 2] < 1.0) | (params[:, 3] > 0.0)).any())
    params = to_device_async(params, logits.device)
    temperature = params[:, 0]
    if needs_filter:
        # Filter the temperature-scaled distribution, then race at temperature 1 (greedy rows stay 0).
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        logits = apply_top_k_top_p_min_p(scaled, params[:, 1].long(), params[:, 2], params[:, 3])
        temperature = (temperature > 0).float()
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)
    for row, request in enumerate(requests):
        if request.generator is not None:
            # Drawn on the CPU, so a seed gives the same tokens on every device.
            draw = torch.empty(noise.shape[-1]).exponential_(generator=request.generator)
            noise[row] = to_device_async(draw, noise.device)
    return ops_for(logits).sample_with_noise(logits, temperature, noise)
