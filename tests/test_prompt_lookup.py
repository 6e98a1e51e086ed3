"""The n-gram proposer's search (``prompt_lookup``): the longest suffix with an earlier
occurrence, its latest occurrence, up to k tokens that followed it; all requests at once equal
each one searched alone by a plain loop."""

from __future__ import annotations

import numpy as np

from hookllm.spec.ngram import prompt_lookup


def lookup(histories: list[list[int]], k: int = 3, min_n: int = 1, max_n: int = 3):
    width = max(len(h) for h in histories)
    tokens = np.full((len(histories), width), -7, dtype=np.int64)
    for row, history in enumerate(histories):
        tokens[row, :len(history)] = history
    proposals, counts = prompt_lookup(tokens, np.array([len(h) for h in histories]), k, min_n, max_n)
    return [p[:c].tolist() for p, c in zip(proposals, counts)]


def plain_lookup(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(history) <= n:
            continue
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + k]
    return []


def test_a_repeated_phrase_proposes_what_followed_it():
    assert lookup([[5, 6, 7, 8, 9, 5, 6, 7]]) == [[8, 9, 5]]


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    # "2 3" occurred at the start (then 40); "3" alone occurred later (then 50).
    assert lookup([[2, 3, 40, 3, 50, 2, 3]], k=1) == [[40]]


def test_of_equal_matches_the_latest_is_taken():
    assert lookup([[1, 2, 10, 1, 2, 20, 1, 2]], k=1, max_n=2) == [[20]]


def test_the_proposal_stops_where_the_history_does():
    assert lookup([[4, 9, 4]], k=5) == [[9, 4]]


def test_no_earlier_occurrence_proposes_nothing():
    assert lookup([[1, 2, 3, 4], [7]]) == [[], []]


def test_suffixes_shorter_than_min_n_are_not_looked_up():
    assert lookup([[3, 8, 1, 3]], min_n=2) == [[]]


def test_a_batch_equals_each_request_alone():
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist() for _ in range(200)]
    for k, min_n, max_n in ((1, 1, 1), (3, 1, 3), (5, 2, 4)):
        assert lookup(histories, k, min_n, max_n) == [plain_lookup(h, k, min_n, max_n) for h in histories]
