"""Prompt lookup (the ``ngram`` proposer's search): a request's last n tokens looked up earlier in
its own prompt and output; what followed there is the guess.

For each request, the longest suffix n-gram (``max_n`` down to ``min_n`` tokens) with an earlier
occurrence wins, and of its occurrences the latest (recent text predicts best); the proposal is
up to ``k`` tokens that followed it, as many as the history holds. All requests are searched at
once, one n at a time, over their histories padded into one array.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def prompt_lookup(tokens: np.ndarray, lengths: np.ndarray, k: int, min_n: int,
                  max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` ``[requests, width]`` (row r's first ``lengths[r]`` are its prompt and output so
    far; the rest is padding) -> each request's proposal ``[requests, k]`` (-1 past its count) and
    the counts (0: no earlier occurrence of any suffix of ``min_n`` to ``max_n`` tokens)."""
    requests, width = tokens.shape
    proposals = np.full((requests, k), -1, dtype=np.int64)
    counts = np.zeros(requests, dtype=np.int64)
    pending = np.ones(requests, dtype=bool)
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        rows = np.flatnonzero(pending & (lengths > n))
        if not len(rows):
            continue
        history, length = tokens[rows], lengths[rows]
        suffix = np.take_along_axis(history, length[:, None] - n + np.arange(n), axis=1)
        matches = (sliding_window_view(history, n, axis=1) == suffix[:, None, :]).all(axis=2)
        # An earlier occurrence with a token after it: it starts before length - n, where the
        # suffix itself starts (so it also lies wholly within the history, not the padding).
        matches &= np.arange(width - n + 1)[None, :] < (length - n)[:, None]
        found = matches.any(axis=1)
        if not found.any():
            continue
        rows, history, length, matches = rows[found], history[found], length[found], matches[found]
        latest = width - n - np.argmax(matches[:, ::-1], axis=1)
        follow = latest[:, None] + n + np.arange(k)[None, :]
        inside = follow < length[:, None]
        proposals[rows] = np.where(inside, np.take_along_axis(history, np.minimum(follow, width - 1), axis=1), -1)
        counts[rows] = inside.sum(axis=1)
        pending[rows] = False
    return proposals, counts
