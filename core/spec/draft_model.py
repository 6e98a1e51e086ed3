"""The ``draft_model`` proposer: a small model of the target's tokenizer guesses greedily.

The draft (``speculative_config``'s ``model``, e.g. Llama-3.2-1B for Llama-3.1-8B) is loaded by
the engine like the target and keeps its K/V in the target's blocks
(:class:`hookllm.spec.proposer.ModelProposer`): it runs over every step's tokens after the target,
so its cache holds what the target's does, and then guesses k tokens per request with k steps
of one token each from the request's last one (on CUDA both replay graphs: its pass in graphs of
the target's step shapes, its k guessing steps in one). Greedy guesses are exact to verify
whatever the requests' sampling: verification keeps what the target itself samples.
"""

from __future__ import annotations

import torch
from torch import nn

from hookllm.spec.proposer import ModelProposer, ProposalBatch, Proposals, StepTokens
from hookllm.utils import to_device_async
from hookllm.worker.forward_context import AttentionMetadata, set_forward_context


class DraftModelProposer(ModelProposer):
    def follow(self, step: StepTokens) -> None:
        if self.step_graphs is None or self.step_graphs.run_step(step.input_ids, step.positions, step.metadata) is None:
            with set_forward_context(step.metadata):
                self.model(step.input_ids, step.positions, None)

    def step_model(self) -> nn.Module:
        return self.model

    def propose(self, batch: ProposalBatch) -> Proposals:
        last = batch.num_tokens - 1  # each request's last token: computed by neither model yet
        counts, index, steps = self.guessing_steps(batch, last)
        if steps is None:
            return self.proposals(batch, counts, index, None)
        tokens = to_device_async(torch.from_numpy(batch.token_ids[index, last[index]]), steps.positions.device)
        return self.proposals(batch, counts, index, self.chain_guesses(tokens, None, steps))

    def guess(self, tokens: torch.Tensor, state: None, positions: torch.Tensor,
              metadata: AttentionMetadata) -> tuple[torch.Tensor, None]:
        with set_forward_context(metadata):
            hidden_states = self.model(tokens, positions, None)
        return self.model.compute_logits(hidden_states).argmax(dim=-1), None
