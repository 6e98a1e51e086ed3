"""The default sampler: greedy, temperature, top-k, top-p and min-p, batched over requests.

Every row is sampled the same way (exponential-race sampling: ``argmax(probs / q)`` with
``q ~ Exp(1)``, which draws from ``probs``), in one pass over the logits on CUDA
(``sample_with_noise`` in :mod:`hookllm.kernels`). Rows without a seed draw ``q`` from the
engine's generator. A request with a seed draws it from a counter-based hash of (seed, position
of the token being sampled, vocabulary index), computed on the logits' device for all seeded
rows at once: the noise depends on nothing else, so a seed gives the same tokens alone or in
any batch, with sync or async scheduling, after a preemption, and on the CPU or CUDA.
"""

from __future__ import annotations

import functools
from typing import Sequence, TypeVar

import numpy as np
import torch

from hookllm.kernels import ops_for
from hookllm.utils import to_device_async
from hookllm.batch import RequestState

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # scrambled into each word, so a zero word does not hash to zero

# Python ints, int64 numpy arrays and int64 tensors: the hash runs on each with the same code.
Words = TypeVar("Words", int, np.ndarray, torch.Tensor)


def _mul32(x: Words, c: int) -> Words:
    """``x * c`` mod 2^32 for ``x`` in [0, 2^32), in place on arrays. ``c`` is split into 16-bit
    halves so that no product leaves int64 (a wrapped product is undefined behaviour in C++)."""
    high = x * (c >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= c & 0xFFFF
    x += high
    x &= MASK32
    return x


def _fmix32(h: Words) -> Words:
    """murmur3's 32-bit finalizer of ``h`` in [0, 2^32), in place on arrays."""
    h ^= h >> 16
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def _scramble(word: Words) -> Words:
    return _fmix32(word ^ GOLDEN)


def _absorb(h: Words, word: Words) -> Words:
    """The hash state ``h`` with one more 32-bit word mixed in. The word is scrambled before the
    xor, so two states differing in a few bits do not give the same stream shifted."""
    return _fmix32(h ^ _scramble(word))


def seeded_row_keys(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """The 32-bit hash state of each (seed, position) pair, on the host (int64).

    A seed is any Python int: folded to 64 bits (so ``-1`` is ``2**64 - 1``), both 32-bit
    halves are hashed. ``positions`` are the sampled tokens' indices in their sequences.
    """
    halves = np.array([(seed & MASK32, (seed >> 32) & MASK32) for seed in seeds], dtype=np.int64).reshape(-1, 2)
    keys = _absorb(_absorb(np.zeros(len(halves), dtype=np.int64), halves[:, 0]), halves[:, 1])
    return _absorb(keys, np.asarray(positions, dtype=np.int64))


@functools.lru_cache(maxsize=8)
def _scrambled_vocab(vocab: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a plain tensor: the cache outlives the inference_mode that built it
        return _scramble(torch.arange(vocab, dtype=torch.int64, device=device))


def seeded_exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[len(keys), vocab]`` (float32) for ``seeded_row_keys`` (int64, on the device).

    Element ``j`` of a row is ``-log(u)`` with ``u = (b + 0.5) / 2**24``, ``b`` the top 24 bits
    of the row's hash with ``j`` absorbed: ``u`` is in (0, 1), so the noise is finite and
    positive. The integers are exact in int64, and ``u`` (which float32 cannot hold exactly)
    and the log are computed in float64 before rounding to float32, so CPU and CUDA agree.
    """
    bits = _fmix32(keys[:, None] ^ _scrambled_vocab(vocab, keys.device)[None, :])
    bits >>= 8
    uniform = bits.double()
    del bits  # frees a [rows, vocab] int64 tensor before the float32 result is allocated
    uniform += 0.5
    uniform *= 2.0 ** -24
    return uniform.log_().neg_().float()


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


def sample(logits: torch.Tensor, requests: Sequence[RequestState], generator: torch.Generator | None,
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
    needs_filter = bool(((params[:, 1] > 0) | (params[:, 2] < 1.0) | (params[:, 3] > 0.0)).any())
    params = to_device_async(params, logits.device)
    temperature = params[:, 0]
    if needs_filter:
        # Filter the temperature-scaled distribution, then race at temperature 1 (greedy rows stay 0).
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        logits = apply_top_k_top_p_min_p(scaled, params[:, 1].long(), params[:, 2], params[:, 3])
        temperature = (temperature > 0).float()
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)
    seeded = [(row, r.sampling_params.seed, position) for row, (r, position) in enumerate(zip(requests, positions))
              if r.sampling_params.seed is not None and r.sampling_params.temperature > 0]
    if seeded:
        rows, seeds, seeded_positions = zip(*seeded)
        # One copy for all seeded rows: their row indices and hash keys.
        table = to_device_async(torch.from_numpy(np.stack([np.asarray(rows, dtype=np.int64),
                                                           seeded_row_keys(seeds, seeded_positions)])), noise.device)
        noise.index_copy_(0, table[0], seeded_exponential_noise(table[1], noise.shape[-1]))
    return ops_for(logits).sample_with_noise(logits, temperature, noise)
