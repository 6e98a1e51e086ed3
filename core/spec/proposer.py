"""The proposer contract: what speculative decoding asks of a method that guesses tokens.

After each step that speculates, the model runner hands the proposer one
:class:`ProposalBatch`: the requests that sampled (those whose sampling allows drafts), each
one's whole token history with the tokens this step emitted, and the target model's hidden
states of the rows it verified. The proposer returns up to ``num_speculative_tokens`` guesses
per request; the next step feeds them to the target after the request's last token, and
verification keeps the longest prefix the target itself samples (:mod:`hookllm.spec.verify`).
A guess changes nothing but speed: wrong ones cost a row of the next step each.

Proposers are named components: a plugin registers a class with the ``register_spec_proposers``
hook, ``speculative_config``'s ``method`` picks it, and each worker makes one with
``cls(config, context)``. It runs on the worker's thread, between steps: a proposer that raises
only loses that step's guesses (logged once), never a request.

A proposer with a model of its own (:class:`ModelProposer`: ``draft_model``, ``eagle3``) is handed
the model the engine loaded from ``speculative_config``'s ``model``: its attention layers keep
their K/V in the engine's paged cache beside the target's, in the same blocks (a position's K/V
lives in the block the target's does), so prefix caching, preemption and rollback need nothing
of it. It runs over every step's tokens after the target (``follow``), and ``propose`` runs its
guessing steps at the positions after each request's history (``ProposalBatch.kv``), where the
scheduler keeps ``num_speculative_tokens`` slots ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
import torch

from hookllm.plugins.components import ComponentKind, Components

if TYPE_CHECKING:
    from torch import nn

    from hookllm.plugins.context import EngineContext
    from hookllm.spec.config import SpeculativeConfig
    from hookllm.spec.draft_kv import DraftKV, GuessSteps
    from hookllm.spec.guess_graphs import GuessGraphs
    from hookllm.worker.batch import CachedRequestState
    from hookllm.worker.cuda_graph import CudaGraphRunner
    from hookllm.worker.forward_context import AttentionMetadata


@dataclass
class ProposalBatch:
    """The requests a proposer guesses for, after one step, in order."""

    requests: Sequence[CachedRequestState]  # read-only: id, sampling parameters, prompt
    token_ids: np.ndarray  # [requests, width] int64: each one's prompt and output so far, then -1 padding
    num_tokens: np.ndarray  # [requests] int64: the length of each history in token_ids
    num_speculative_tokens: int  # the most guesses a request may get
    # [rows, hidden] on the device: the target's last hidden states at the rows this step
    # verified (a request's emitted tokens came from its first ``num_emitted`` rows).
    hidden_states: torch.Tensor | None = None
    hidden_rows: np.ndarray | None = None  # [requests] int64: each request's first row in hidden_states
    num_emitted: np.ndarray | None = None  # [requests] int64: tokens each request emitted this step
    # A ModelProposer's: attention metadata for its own steps at the positions after each history.
    kv: DraftKV | None = None
    token_index: np.ndarray | None = None  # [requests] int64: each one's first verified row among the step's tokens

    def history(self, index: int) -> list[int]:
        """The token ids of request ``index``: its prompt and output so far."""
        return self.token_ids[index, :self.num_tokens[index]].tolist()


@dataclass
class StepTokens:
    """A step's tokens as a model proposer's ``follow`` reads them, after the target's forward."""

    request_ids: Sequence[str]  # each sequence's request, in the step's order
    input_ids: torch.Tensor  # [tokens] on the device, sequences one after another
    positions: torch.Tensor  # [tokens]
    hidden_states: torch.Tensor  # [tokens, hidden]: the target's (after its final norm)
    query_start: np.ndarray  # [sequences + 1] host int64: sequence s is tokens query_start[s]:query_start[s + 1]
    num_computed: np.ndarray  # [sequences] host int64: each sequence's first position in the step
    metadata: AttentionMetadata  # the step's own
    kv: DraftKV  # metadata of other runs of these sequences' positions (``kv.rows``: their rows)


# What a proposer returns: per request a list of guessed ids, or a [requests, k] int array padded
# with -1 (``counts`` then tells how many of each row are guesses).
Proposals = Sequence[Sequence[int]] | tuple[np.ndarray, np.ndarray]


class Proposer(Protocol):
    """A speculative decoding method: made once per worker, ``cls(config, context)``."""

    def __init__(self, config: SpeculativeConfig, context: EngineContext) -> None:
        """``config`` is the engine's ``speculative_config``; ``context`` its plugins' context."""

    def propose(self, batch: ProposalBatch) -> Proposals:
        """Guess each request's next tokens: up to ``batch.num_speculative_tokens`` ids per
        request (fewer, or none, where it has no good guess)."""


class ModelProposer:
    """Base of proposers that run a model of their own, which the engine loads from
    ``speculative_config``'s ``model`` (with the ``load_model`` hook, as the target) and hands to
    ``cls(config, context, model, target)`` before it measures memory or captures graphs. Its
    ``hookllm.layers.Attention`` layers get cache slots beside the target's layers (the engine's
    memory budget counts them and its weights)."""

    # True for a head over the target's features (EAGLE): it serves the target's positions,
    # whatever its own config's max_position_embeddings.
    head_of_target: bool = False
    # On CUDA, the engine's graphs of ``step_model()`` at the target's step shapes, for ``follow``.
    step_graphs: CudaGraphRunner | None = None
    # On CUDA, the engine's graphs of ``guess`` chained k times (``chain_guesses`` replays them).
    guess_graphs: GuessGraphs | None = None

    def __init__(self, config: SpeculativeConfig, context: EngineContext, model: nn.Module, target: nn.Module) -> None:
        self.config = config
        self.context = context
        self.model = model
        self.target = target  # the engine's model, loaded

    def follow(self, step: StepTokens) -> None:
        """Run over a step's tokens after the target did (every step, speculating or not): the
        model's K/V at those positions join the cache (``step.metadata`` is the step's own)."""
        raise NotImplementedError

    def propose(self, batch: ProposalBatch) -> Proposals:
        raise NotImplementedError

    def step_model(self) -> nn.Module | None:
        """What ``follow`` runs over a step's tokens, as the engine's graphs call a model
        (``forward(input_ids, positions)``, the step's shape): the engine captures it in
        ``step_graphs``. None (the default): no graphs."""
        return None

    def guess(self, tokens: torch.Tensor, state: torch.Tensor | None, positions: torch.Tensor,
              metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One guessing step: each request's next guess after ``tokens`` (at ``positions``), from
        the ``state`` the step before returned (None before the first where ``guess_state`` is
        None); returns both for the next step. Device work only: the engine captures it in a graph."""
        raise NotImplementedError

    def guess_state(self, num_requests: int) -> torch.Tensor | None:
        """A tensor of the shape, dtype and device of ``guess``'s state for that many requests,
        or None if it keeps none."""
        return None

    def guessing_steps(self, batch: ProposalBatch,
                       first: np.ndarray) -> tuple[np.ndarray, np.ndarray, GuessSteps | None]:
        """How many tokens each request may guess (up to k, as its blocks have room from position
        ``first`` on), the requests that may guess any, and their one-token steps from ``first``:
        k steps where graphs are captured, else as many as any of them takes."""
        counts = np.minimum(batch.kv.room(first), batch.num_speculative_tokens)
        index = np.flatnonzero(counts)
        if not len(index):
            return counts, index, None
        num_steps = batch.num_speculative_tokens if self.guess_graphs is not None else int(counts[index].max())
        return counts, index, batch.kv.decode_steps(index, first[index], num_steps)

    def chain_guesses(self, tokens: torch.Tensor, state: torch.Tensor | None, steps: GuessSteps) -> torch.Tensor:
        """``[requests, steps]`` guesses: ``guess`` over each of ``steps`` in turn, from ``tokens``
        and ``state`` (one replay where graphs are captured)."""
        if self.guess_graphs is not None and self.guess_graphs.can_run(steps):
            return self.guess_graphs.run(tokens, state, steps)
        return self.guess_eagerly(tokens, state, steps)

    def guess_eagerly(self, tokens: torch.Tensor, state: torch.Tensor | None, steps: GuessSteps) -> torch.Tensor:
        """``chain_guesses`` without graphs (what the graphs capture)."""
        guessed = []
        for positions, metadata in steps:
            tokens, state = self.guess(tokens, state, positions, metadata)
            guessed.append(tokens)
        return torch.stack(guessed, dim=1)

    @staticmethod
    def proposals(batch: ProposalBatch, counts: np.ndarray, index: np.ndarray,
                  guessed: torch.Tensor | None) -> Proposals:
        """The answer to ``propose``: the requests ``index`` guessed ``guessed`` (``counts`` of each valid)."""
        guesses = np.full((len(batch.requests), batch.num_speculative_tokens), -1, dtype=np.int64)
        if guessed is not None:
            guesses[index, :guessed.shape[1]] = guessed.cpu().numpy()
        return guesses, counts


class SpecProposers:
    """What ``register_spec_proposers`` receives: ``add(name, cls)`` registers a proposer class,
    chosen by ``speculative_config``'s ``method`` NAME."""

    def __init__(self, components: Components):
        self.components = components

    def add(self, name: str, proposer: type[Proposer]) -> None:
        self.components.add(ComponentKind.SPEC_PROPOSER, name, proposer)
