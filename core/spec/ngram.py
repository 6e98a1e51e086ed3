"""Prompt lookup (the ``ngram`` proposer's search): a request's last n tokens looked up earlier in
its own prompt and output; what followed there is the guess.

For each request, the longest suffix n-gram (``max_n`` down to ``min_n`` tokens) with an earlier
occurrence wins, and of its occurrences the latest (recent text predicts best); the proposal is
up to ``k`` tokens that followed it, as many as the history holds. All requests are searched at
once over their histories padded into one array, growing n from 1: an occurrence of the last n
tokens ending at position e is one of the last n - 1 tokens ending there whose token n back
also matches, so each n costs one comparison per position (not n).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hookllm.plugins.context import EngineContext
    from hookllm.spec.config import SpeculativeConfig
    from hookllm.spec.proposer import ProposalBatch


def prompt_lookup(tokens: np.ndarray, lengths: np.ndarray, k: int, min_n: int,
                  max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` ``[requests, width]`` (row r's first ``lengths[r]`` are its prompt and output so
    far; the rest is padding) -> each request's proposal ``[requests, k]`` (-1 past its count) and
    the counts (0: no earlier occurrence of any suffix of ``min_n`` to ``max_n`` tokens)."""
    requests, width = tokens.shape
    proposals = np.full((requests, k), -1, dtype=np.int64)
    counts = np.zeros(requests, dtype=np.int64)
    if width < 2 or not requests:
        return proposals, counts
    rows = np.arange(requests)
    # Column c is the occurrence ending at e = c + 1 (its tokens end at e - 1; e's token followed
    # it). It counts only if e < length: a token follows it within the history, and it ends
    # before the suffix itself does.
    ends = np.arange(1, width)
    matches = ends[None, :] < lengths[:, None]
    best_end = np.full(requests, -1, dtype=np.int64)
    for n in range(1, max_n + 1):
        back = ends - n  # where the occurrence's n-th token from its end lies
        suffix_token = tokens[rows, np.maximum(lengths - n, 0)]
        matches[:, back < 0] = False
        matches[:, back >= 0] &= tokens[:, back[back >= 0]] == suffix_token[:, None]
        matches &= (lengths > n)[:, None]  # the suffix leaves room for an earlier occurrence
        found = matches.any(axis=1)
        if not found.any():
            break
        if n >= min_n:
            latest = matches.shape[1] - 1 - np.argmax(matches[found, ::-1], axis=1)
            best_end[found] = latest + 1
    found = best_end >= 0
    follow = best_end[found, None] + np.arange(k)[None, :]
    inside = follow < lengths[found, None]
    proposals[found] = np.where(inside, tokens[np.flatnonzero(found)[:, None], np.minimum(follow, width - 1)], -1)
    counts[found] = inside.sum(axis=1)
    return proposals, counts


class NgramProposer:
    """``method: ngram``: each request's guess is :func:`prompt_lookup` over its prompt and
    output, suffixes of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens."""

    def __init__(self, config: SpeculativeConfig, context: EngineContext):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: ProposalBatch) -> tuple[np.ndarray, np.ndarray]:
        return prompt_lookup(batch.token_ids, batch.num_tokens, self.k, self.min_n, self.max_n)
