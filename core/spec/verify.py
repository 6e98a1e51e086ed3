"""Verification and proposing, the model runner's side of speculative decoding.

A request verifying ``k`` drafts runs ``k + 1`` rows in the target's step: its last token, then
the drafts. Every row is sampled as any row is (the penalties stage, the plugins' logits hooks,
the ``sample`` hook), at the position of the token it predicts; the request keeps the drafts
up to the first one that differs from what its row sampled, then that row's sample (or, all
drafts kept, the last row's). Each emitted token is thus exactly what the target draws at its
position given the tokens before it, so output does not change, only speed: greedy requests
give the same tokens, and a seeded request, whose noise hangs on (seed, position) alone, the
same tokens too. This is Leviathan et al.'s rejection sampling for a proposer that picks its
tokens (a one-hot ``q``: a draft is kept with probability ``p(draft)``, and a rejected position
draws from ``p`` without it), with the sampler's own randomness deciding both.

The penalties stage counts, for each row, its request's output and the drafts before the row;
a plugin's logits hooks do as its ``drafted_extra_args`` claim says (the structured output
plugin masks each row after the drafts before it). A request carrying other plugins'
per-request arguments in ``extra_args`` gets no drafts: it decodes one token a step, unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from hookllm.outputs import LogprobsRow
from hookllm.spec.config import SpeculativeConfig
from hookllm.spec.proposer import ModelProposer, ProposalBatch, Proposals, Proposer, StepTokens

if TYPE_CHECKING:
    from hookllm.worker.batch import CachedRequestState

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeOutput:
    """What a step that speculates gives the scheduler, per sampling request (plain data)."""

    token_ids: list[list[int]]  # the tokens it emitted: the drafts kept, then one the target drew
    logprobs: list[list[LogprobsRow | None]]  # one row per emitted token (None where not asked)
    draft_token_ids: list[list[int]]  # the proposer's guesses for its next step (may be empty)


def num_verified_rows(drafts: Sequence[Sequence[int]]) -> np.ndarray:
    """Each request's rows in a speculating step's logits: its drafts and one more."""
    return np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts)) + 1


def verified_row_starts(drafts: Sequence[Sequence[int]]) -> np.ndarray:
    """Each request's first row among a speculating step's verified rows."""
    rows = num_verified_rows(drafts)
    return np.cumsum(rows) - rows


def runs_ending_at(last: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each ``last[i]`` expanded to the ``lengths[i]`` consecutive values ending there, in order:
    ([5, 9], [2, 3]) -> [4, 5, 7, 8, 9]."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    offsets = np.arange(len(owner)) - (np.cumsum(lengths) - lengths)[owner]
    return (last - lengths + 1)[owner] + offsets


def takes_drafts(request: CachedRequestState, drafted_extra_args: frozenset[str]) -> bool:
    """Whether a request's sampling allows drafts: every ``extra_args`` key it carries is one
    whose plugin handles drafted rows (see the module's note)."""
    return request.pooling_params is None and drafted_extra_args.issuperset(request.sampling_params.extra_args)


def num_emitted(sampled: np.ndarray, draft_ids: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Each request's emitted count: 1 + the drafts kept, the leading drafts equal to what their
    rows sampled. ``sampled`` holds every request's ``num_drafts + 1`` rows in order,
    ``draft_ids`` every request's drafts in order."""
    if not len(draft_ids):
        return np.ones(len(num_drafts), dtype=np.int64)
    rows = num_drafts + 1
    first_row = np.cumsum(rows) - rows
    first_draft = np.cumsum(num_drafts) - num_drafts
    owner = np.repeat(np.arange(len(num_drafts)), num_drafts)
    index = np.arange(len(draft_ids)) - first_draft[owner]
    mismatch = sampled[first_row[owner] + index] != draft_ids
    # The first mismatch per request (num_drafts where every draft matched).
    first_miss = num_drafts.copy()
    np.minimum.at(first_miss, owner[mismatch], index[mismatch])
    return first_miss + 1


class SpecDecoder:
    """The runner's speculative decoding: its proposer, and what verifying a step takes."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, drafted_extra_args: frozenset[str] = frozenset()):
        self.config = config
        self.proposer = proposer
        self.drafted_extra_args = drafted_extra_args  # the active plugins' (hookllm.plugins.context.RequestParameters)
        self.failed = False  # the proposer raised once: logged, and every later failure is quiet

    def verify(self, sampled: list[int], logprobs: list[LogprobsRow | None], drafts: Sequence[Sequence[int]]
               ) -> tuple[list[list[int]], list[list[LogprobsRow | None]], np.ndarray]:
        """The tokens (and logprobs rows) each request emits from its rows' ``sampled`` tokens,
        and how many each emits."""
        num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
        draft_ids = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(num_drafts.sum()))
        counts = num_emitted(np.asarray(sampled, dtype=np.int64), draft_ids, num_drafts)
        starts = verified_row_starts(drafts).tolist()
        tokens = [sampled[start:start + count] for start, count in zip(starts, counts.tolist())]
        rows = [logprobs[start:start + count] for start, count in zip(starts, counts.tolist())]
        return tokens, rows, counts

    @property
    def follows_steps(self) -> bool:
        """Whether the proposer runs over every step's tokens (a model proposer, not failed)."""
        return isinstance(self.proposer, ModelProposer) and not self.failed

    def follow(self, step: StepTokens) -> None:
        """A model proposer's pass over a step's tokens, after the target's (its K/V there). If
        it raises, speculation stops (logged): its cache would lack those tokens."""
        try:
            self.proposer.follow(step)
        except Exception:  # noqa: BLE001 - as in propose
            logger.exception("the speculative decoding proposer %r failed: decoding goes on without drafts",
                             self.config.method)
            self.failed = True

    def propose(self, batch: ProposalBatch, vocab_size: int) -> list[list[int]]:
        """The proposer's guesses for ``batch``, each cut to ``num_speculative_tokens`` and before
        any id outside the vocabulary; none (logged) if it raises or answers out of shape, and
        none from a model proposer whose pass over the tokens failed."""
        if self.failed and isinstance(self.proposer, ModelProposer):
            return [[] for _ in batch.requests]
        try:
            return _guesses(self.proposer.propose(batch), len(batch.requests), batch.num_speculative_tokens,
                            vocab_size)
        except Exception:  # noqa: BLE001 - a proposer's failure loses its guesses, never a request
            if not self.failed:
                logger.exception("the speculative decoding proposer %r failed: these steps decode without drafts",
                                 self.config.method)
            self.failed = True
            return [[] for _ in batch.requests]


def _guesses(proposals: Proposals, num_requests: int, k: int, vocab_size: int) -> list[list[int]]:
    """A proposer's answer as one list of valid ids per request."""
    if isinstance(proposals, tuple) and len(proposals) == 2 and isinstance(proposals[0], np.ndarray):
        ids, counts = proposals
        guesses = [row[:count].tolist() for row, count in zip(ids, np.asarray(counts).tolist())]
    else:
        guesses = [list(map(int, guess)) for guess in proposals]
    if len(guesses) != num_requests:
        raise ValueError(f"propose returned guesses for {len(guesses)} requests, the batch has {num_requests}")
    return [_valid_prefix(guess[:k], vocab_size) for guess in guesses]


def _valid_prefix(guess: list[int], vocab_size: int) -> list[int]:
    for i, token_id in enumerate(guess):
        if not 0 <= token_id < vocab_size:
            return guess[:i]
    return guess
