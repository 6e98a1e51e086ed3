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

from itertools import chain
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


def sampler_table(requests: Sequence[CachedRequestState]) -> np.ndarray:
    """``[5, len(requests)]`` float32: each request's ``sampler_row`` as a column."""
    entries = [r.sampler_row for r in requests]
    return np.fromiter(chain.from_iterable(entries), dtype=np.float32, count=5 * len(entries)).reshape(-1, 5).T


def sample(logits: torch.Tensor, requests: Sequence[CachedRequestState], generator: torch.Generator | None,
           positions: Sequence[int], table: np.ndarray | None = None) -> torch.Tensor:
    """One token id per row of ``logits`` for the matching request in ``requests``; ``positions``
    holds each row's sampled-token index in its sequence (the counter of seeded noise).
    ``table`` is the requests' ``sampler_table`` where the caller keeps it (``Batch.sampler_table``)."""
    # One host table and one copy for the whole batch, a row per parameter (each row on the
    # device a contiguous view): temperature, top_k, top_p, min_p, seeded.
    table = np.array(sampler_table(requests) if table is None else table, dtype=np.float32, order="C")
    temperature, top_k, top_p, min_p, seeded_rows = table
    top_k[top_k >= logits.shape[1]] = 0  # a top-k of the whole vocabulary keeps every token
    sampled = temperature > 0
    if not sampled.any():
        return logits.argmax(dim=-1)
    # Which filters the sampled rows ask for, decided on the host table (numpy: no device sync,
    # and a microsecond where a torch op on a small CPU tensor costs several).
    has_top_p = sampled & (top_p < 1.0)
    if (has_top_p & (top_k <= 0)).any():
        needed = logits.shape[1]  # a nucleus without a top-k: every logit may count
    else:
        needed = int(np.where(sampled, top_k, 0).max())
    params = to_device_async(torch.from_numpy(table), logits.device)
    ops = ops_for(logits)
    threshold = None
    if needed or (sampled & (min_p > 0.0)).any():
        threshold = ops.filter_thresholds(logits, params[0], params[1], params[2], params[3], needed,
                                          bool(has_top_p.any()))
    # Each row's noise is hashed from a 32-bit key inside the sampling kernel: a random key for
    # a row without a seed (the engine's generator), the hash of (seed, position) for a seeded one.
    keys = torch.randint(0, 2**32, (len(requests),), generator=generator, device=logits.device)
    rows = np.flatnonzero(seeded_rows)
    if len(rows):
        seeds = [requests[row].sampling_params.seed for row in rows]
        # One copy for all seeded rows: their row indices and keys.
        seeded_keys = to_device_async(torch.from_numpy(np.stack([rows.astype(np.int64), seeded_row_keys(
            seeds, [positions[row] for row in rows])])), keys.device)
        keys.index_copy_(0, seeded_keys[0], seeded_keys[1])
    return ops.sample_with_hashed_noise(logits, params[0], keys, threshold)
