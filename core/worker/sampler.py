"""The default sampler: greedy, temperature, top-k, top-p and min-p, batched over requests.

Every row is sampled the same way (exponential-race sampling: ``argmax(probs / q)`` with
``q ~ Exp(1)``, which draws from ``probs``), in one pass over the logits on CUDA
(``sample_with_hashed_noise`` in :mod:`hookllm.kernels`), which hashes each row's ``q`` from a
32-bit key and the vocabulary index as it goes: no noise tensor is ever written. A row without
a seed gets a random key from the engine's generator; a request with a seed gets the hash of
(seed, position of the token being sampled). Its noise depends on nothing else, so a seed gives
the same tokens alone or in any batch, with sync or async scheduling, after a preemption, and
on the CPU or CUDA.

Top-k, top-p and min-p become one threshold logit per row (``filter_thresholds`` in
:mod:`hookllm.kernels`), which the sampling kernel applies as it streams the logits: no masked
copy of the logits is written. On CUDA one Triton kernel finds the thresholds without sorting
the vocabulary; the torch reference (CPU) takes ``topk`` of the largest top-k, or sorts the
vocabulary for a top-p without a top-k.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hookllm.kernels import ops_for
from hookllm.kernels.reference import MASK32, absorb
from hookllm.utils import to_device_async
from hookllm.worker.batch import CachedRequestState


def seeded_row_keys(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """The 32-bit hash state of each (seed, position) pair, on the host (int64).

    A seed is any Python int: folded to 64 bits (so ``-1`` is ``2**64 - 1``), both 32-bit
    halves are hashed. ``positions`` are the sampled tokens' indices in their sequences.
    """
    halves = np.array([(seed & MASK32, (seed >> 32) & MASK32) for seed in seeds], dtype=np.int64).reshape(-1, 2)
    keys = absorb(absorb(np.zeros(len(halves), dtype=np.int64), halves[:, 0]), halves[:, 1])
    return absorb(keys, np.asarray(positions, dtype=np.int64))


def sample(logits: torch.Tensor, requests: Sequence[CachedRequestState], generator: torch.Generator | None,
           positions: Sequence[int]) -> torch.Tensor:
    """One token id per row of ``logits`` for the matching request in ``requests``; ``positions``
    holds each row's sampled-token index in its sequence (the counter of seeded noise)."""
    # One host table and one copy for the whole batch: temperature, top_k, top_p, min_p.
    params = torch.tensor(
        [(p.temperature, p.top_k, p.top_p, p.min_p) for p in (r.sampling_params for r in requests)],
        dtype=torch.float32,
    )
    if bool((params[:, 0] == 0.0).all()):
        return logits.argmax(dim=-1)
    # Which filters the sampled rows ask for, decided on the host table.
    sampled = params[:, 0] > 0
    top_k = torch.where(sampled, params[:, 1], 0.0)
    has_top_p, has_min_p = (params[:, 2] < 1.0) & sampled, (params[:, 3] > 0.0) & sampled
    if bool((has_top_p & (top_k <= 0)).any()):
        needed = logits.shape[1]  # a nucleus without a top-k: every logit may count
    else:
        needed = int(top_k.max())
    any_top_p = bool(has_top_p.any())
    params = to_device_async(params, logits.device)
    ops = ops_for(logits)
    temperature = params[:, 0]
    threshold = None
    if needed or bool(has_min_p.any()):
        threshold = ops.filter_thresholds(logits, temperature, params[:, 1].long(), params[:, 2], params[:, 3], needed,
                                      any_top_p)
    # Each row's noise is hashed from a 32-bit key inside the sampling kernel: a random key for
    # a row without a seed (the engine's generator), the hash of (seed, position) for a seeded one.
    keys = torch.randint(0, 2**32, (len(requests),), generator=generator, device=logits.device)
    seeded = [(row, r.sampling_params.seed, position) for row, (r, position) in enumerate(zip(requests, positions))
              if r.sampling_params.seed is not None and r.sampling_params.temperature > 0]
    if seeded:
        rows, seeds, seeded_positions = zip(*seeded)
        # One copy for all seeded rows: their row indices and keys.
        table = to_device_async(torch.from_numpy(np.stack([np.asarray(rows, dtype=np.int64),
                                                           seeded_row_keys(seeds, seeded_positions)])), keys.device)
        keys.index_copy_(0, table[0], table[1])
    return ops.sample_with_hashed_noise(logits, temperature, keys, threshold)
