"""The ``draft_model`` proposer: a small model of the target's tokenizer guesses greedily.

The draft (``speculative_config``'s ``model``, e.g. Llama-3.2-1B for Llama-3.1-8B) is loaded by
the engine like the target and keeps its K/V in the target's blocks
(:class:`hookllm.spec.proposer.ModelProposer`): it runs over every step's tokens after the target,
so its cache holds what the target's does, and then guesses k tokens per request with k steps
of one token each from the request's last one (on CUDA through decode graphs of its own, as
the target's). Greedy guesses are exact to verify whatever the requests' sampling:
verification keeps what the target itself samples.
"""

from __future__ import annotations

import numpy as np
import torch

from hookllm.spec.proposer import ModelProposer, ProposalBatch, Proposals, StepTokens
from hookllm.worker.forward_context import AttentionMetadata, set_forward_context


class DraftModelProposer(ModelProposer):
    captures_decode_graphs = True

    def follow(self, step: StepTokens) -> None:
        with set_forward_context(step.metadata):
            self.model(step.input_ids, step.positions, None)

    def propose(self, batch: ProposalBatch) -> Proposals:
        k, num = batch.num_speculative_tokens, len(batch.requests)
        last = batch.num_tokens - 1  # each request's last token: computed by neither model yet
        counts = np.minimum(batch.kv.room(last), k)
        guesses = np.full((num, k), -1, dtype=np.int64)
        guessing = np.flatnonzero(counts)
        if not len(guessing):
            return guesses, counts
        steps = batch.kv.decode_steps(guessing, last[guessing], int(counts[guessing].max()))
        device = steps[0][0].device
        tokens = torch.from_numpy(batch.token_ids[guessing, last[guessing]]).to(device, non_blocking=True)
        drafted = []
        for positions, metadata in steps:
            tokens = self.model.compute_logits(self._decode(tokens, positions, metadata)).argmax(dim=-1)
            drafted.append(tokens)
        guesses[guessing, :len(steps)] = torch.stack(drafted, dim=1).cpu().numpy()
        return guesses, counts

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """One guessing step's hidden states: through the draft's decode graphs when captured."""
        graphs = self.graphs
        if graphs is not None and graphs.can_run(len(tokens), len(tokens), 1, metadata.block_tables[0].shape[1]):
            return graphs.run(tokens, positions, torch.stack(metadata.slot_mapping), torch.stack(metadata.block_tables),
                              metadata.seq_lens, metadata.query_start_loc, 1)
        with set_forward_context(metadata):
            return self.model(tokens, positions, None)
