"""Speculative decoding's verification (``rejection_sample`` in ``hookllm.kernels.reference``)
against the formula: whatever the proposer, each emitted token is distributed as the target
alone draws it; the acceptance rate of a draft drawn from q is the overlap of p and q.

Empirical distributions are checked with Pearson's chi-square test at significance 0.001 (the
critical values below are the chi-square distribution's 0.999 quantiles from tables); each draw
is one row with its own noise key, all in one call."""

from __future__ import annotations

import torch

from hookllm.kernels.reference import rejection_sample

VOCAB = 8
DRAWS = 40_000
CHI2_CRITICAL_0_001 = {7: 24.322}  # degrees of freedom (VOCAB - 1) -> 0.999 quantile


def target_logits() -> torch.Tensor:
    return torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8])


def keys(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2**32, (count,), generator=torch.Generator().manual_seed(seed))


def assert_distributed_as(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * tokens.numel()
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < CHI2_CRITICAL_0_001[VOCAB - 1], (statistic, observed.tolist(), expected.tolist())


def one_draft_each(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None = None, temperature: float = 1.0,
                   threshold: torch.Tensor | None = None, seed: int = 0):
    """DRAWS requests with one draft each: rows alternate draft, bonus; the same target logits."""
    n = draft_ids.numel()
    logits = target_logits().repeat(2 * n, 1)
    return rejection_sample(logits, torch.full((2 * n,), temperature), keys(2 * n, seed), threshold, draft_ids,
                            torch.ones(n, dtype=torch.long), 1, draft_probs)


def test_a_chosen_draft_leaves_the_target_distribution():
    # An n-gram proposer always proposes token 0 here: q is one-hot.
    p = target_logits().softmax(-1)
    tokens, _ = one_draft_each(torch.zeros(DRAWS, dtype=torch.long))
    assert_distributed_as(tokens[:, 0], p)


DRAFT_Q = torch.linspace(1.0, 3.0, VOCAB).softmax(-1)  # a proposer's own distribution, unlike the target's


def drawn_drafts(seed: int):
    """DRAWS requests whose one draft each was drawn from DRAFT_Q."""
    drafts = torch.multinomial(DRAFT_Q, DRAWS, replacement=True, generator=torch.Generator().manual_seed(seed))
    return one_draft_each(drafts, DRAFT_Q.repeat(DRAWS, 1), seed=seed + 1)


def test_a_draft_drawn_from_another_distribution_leaves_the_target_distribution():
    tokens, _ = drawn_drafts(1)
    assert_distributed_as(tokens[:, 0], target_logits().softmax(-1))


def test_a_drawn_draft_is_accepted_as_often_as_the_two_distributions_overlap():
    _, emitted = drawn_drafts(3)
    rate = float((emitted == 2).double().mean())
    overlap = float(torch.minimum(target_logits().softmax(-1), DRAFT_Q).sum())
    assert abs(rate - overlap) < 4 * (overlap * (1 - overlap) / DRAWS) ** 0.5


def test_after_an_accepted_draft_the_next_token_follows_its_own_row():
    # Two drafts per request over two different target rows, then a bonus row: given that the
    # first draft was accepted, the second position is distributed as its own row's p.
    first, second = target_logits(), target_logits().flip(0)
    logits = torch.stack([first, second, first]).repeat(DRAWS, 1)
    drafts = torch.tensor([0, 3]).repeat(DRAWS)
    tokens, emitted = rejection_sample(logits, torch.ones(3 * DRAWS), keys(3 * DRAWS, 5), None, drafts,
                                       torch.full((DRAWS,), 2), 2)
    after_accepted = tokens[emitted >= 2, 1]
    assert after_accepted.numel() > DRAWS // 4
    assert_distributed_as(after_accepted, second.softmax(-1))


def test_a_rejected_draft_is_never_the_token_drawn_in_its_place():
    tokens, emitted = one_draft_each(torch.full((2000,), 2, dtype=torch.long), seed=6)
    assert bool((tokens[emitted == 1, 0] != 2).all())


def test_the_threshold_keeps_drawn_tokens_within_the_filter():
    # A top-2 filter: only tokens 0 and 1 may be emitted, whatever was proposed.
    threshold = torch.full((2 * DRAWS,), 1.5)
    tokens, _ = one_draft_each(torch.full((DRAWS,), 5, dtype=torch.long), threshold=threshold, seed=7)
    p = torch.zeros(VOCAB)
    p[:2] = target_logits()[:2].softmax(-1)
    assert set(tokens[:, 0].unique().tolist()) <= {0, 1}
    assert abs(float((tokens[:, 0] == 0).double().mean()) - float(p[0])) < 0.02


def test_greedy_rows_accept_the_argmax_run_then_emit_the_argmax():
    logits = torch.eye(VOCAB)[[1, 2, 3, 4, 5, 6, 7]]  # rows whose argmax is 1, 2, ...
    # Request 0 proposes 1, 2, then 0 where the argmax is 3; request 1 proposes 5 and 6, both right.
    rows = torch.cat([logits[[0, 1, 2, 3]], logits[[4, 5, 6]]])
    drafts = torch.tensor([1, 2, 0, 5, 6])
    tokens, emitted = rejection_sample(rows, torch.zeros(7), keys(7, 8), None, drafts, torch.tensor([3, 2]), 3)
    assert tokens.tolist() == [[1, 2, 3, -1], [5, 6, 7, -1]]
    assert emitted.tolist() == [3, 3]


def test_a_request_without_drafts_emits_its_bonus_row_sample():
    tokens, emitted = rejection_sample(target_logits()[None].repeat(3, 1), torch.tensor([0.0, 1.0, 0.0]),
                                       keys(3, 9), None, torch.tensor([0]), torch.tensor([0, 1]), 1)
    assert tokens[0].tolist() == [0, -1] and emitted[0] == 1


def test_the_same_keys_give_the_same_tokens():
    first = one_draft_each(torch.zeros(500, dtype=torch.long), seed=10)
    again = one_draft_each(torch.zeros(500, dtype=torch.long), seed=10)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
