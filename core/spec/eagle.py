"""The ``eagle3`` proposer: an EAGLE-3 head (``speculative_config``'s ``model``) guesses from the
target's own features.

At position p the head reads the token at p + 1 and the target's fused residual streams at p
(:meth:`hookllm.adapters.llama.eagle3.Eagle3LlamaForCausalLM.fuse`), so its pass over a step's
tokens runs one position behind the target's: a sequence computing positions c .. c + n - 1
gives the head positions c - 1 .. c + n - 2, every input token known, the feature at c - 1 kept
from the sequence's previous step (by persistent-batch row). The last position's turn comes at
the next step, or, for a request that samples, when proposing: its last emitted token joins the
head at position L - 2 (L: the request's tokens) with the feature of the last position the target
kept, then k - 1 more guessing steps each read the head's own output before its norm. Guesses
are greedy over the head's draft vocabulary, mapped to the target's ids. On CUDA the k guessing
steps replay one graph, and the pass over a step's tokens graphs of the target's step shapes.

The target must keep its streams (:class:`hookllm.plugins.contract.SupportsAuxHiddenStates`:
the native Llama family); the layers are the head's (its config, else 2, n / 2 and n - 3).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hookllm.config import text_config_of
from hookllm.plugins.contract import SupportsAuxHiddenStates
from hookllm.spec.proposer import ModelProposer, ProposalBatch, Proposals, StepTokens
from hookllm.worker.forward_context import AttentionMetadata, set_forward_context

HEAD_METHODS = ("aux_layer_ids", "fuse", "share_embedding", "to_target_ids")


class Eagle3Proposer(ModelProposer):
    head_of_target = True

    def __init__(self, config, context, model, target) -> None:
        super().__init__(config, context, model, target)
        if not isinstance(target, SupportsAuxHiddenStates):
            raise ValueError(f"speculative_config method 'eagle3': {type(target).__name__} does not keep the hidden "
                             "states an EAGLE-3 head reads (the native Llama family does)")
        missing = [name for name in HEAD_METHODS if not hasattr(model, name)]
        if missing:
            raise ValueError(f"speculative_config method 'eagle3': {config.model} is not an EAGLE-3 head "
                             f"({type(model).__name__} has no {', '.join(missing)})")
        engine = context.config
        num_layers = text_config_of(context.model_config.hf_config).num_hidden_layers
        layers = model.aux_layer_ids(num_layers)
        if not all(0 <= layer < num_layers for layer in layers):
            raise ValueError(f"speculative_config method 'eagle3': the head reads target layers {list(layers)}, the "
                             f"target has {num_layers} (its config's eagle_aux_hidden_state_layer_ids names them)")
        self.aux = target.keep_aux_hidden_states(layers, max(engine.max_num_batched_tokens, engine.max_num_seqs))
        model.share_embedding(target.embed_tokens)
        self.step_features: torch.Tensor | None = None  # the last step's fused features, [tokens, hidden]
        # By persistent-batch row: the feature at the position before the row's next input, and
        # the request it belongs to (a row taken by another request has none).
        self.row_features = torch.zeros(0, model.config.hidden_size, dtype=self.aux.dtype, device=self.aux.device)
        self.row_request: dict[int, str] = {}
        # The input features of its pass over a step's tokens (a buffer its graphs read).
        self.head_features = self.aux.new_zeros(self.aux.shape[0], model.config.hidden_size)

    def follow(self, step: StepTokens) -> None:
        num_tokens = step.input_ids.shape[0]
        features = self.step_features = self.model.fuse(self.aux[:num_tokens])
        rows = step.kv.rows
        self._grow_rows(int(rows.max()) + 1)
        # The head's pass has the step's shape, each sequence's positions moved back by one where
        # it continues its row's request (the first with the feature kept from its last step);
        # elsewhere the first position has nothing before it, and the last reads its own token
        # (the next is not sampled yet): scratch, written over when the request goes on.
        continues = np.fromiter((self.row_request.get(row) == request_id
                                 for row, request_id in zip(rows.tolist(), step.request_ids)),
                                dtype=bool, count=len(rows)) & (step.num_computed > 0)
        firsts, ends = step.query_start[:-1], step.query_start[1:]
        counts = ends - firsts
        shift = np.repeat(continues, counts).astype(np.int64)
        index = np.arange(num_tokens, dtype=np.int64)
        parts = [np.minimum(index + 1 - shift, np.repeat(ends - 1, counts)), np.maximum(index - shift, 0),
                 firsts[continues], rows[continues], rows, ends - 1]
        flat = torch.from_numpy(np.concatenate(parts)).to(self.aux.device, non_blocking=True)
        ids_t, features_t, kept_t, kept_rows_t, rows_t, last_t = flat.split([len(part) for part in parts])
        torch.index_select(features, 0, features_t, out=self.head_features[:num_tokens])
        self.head_features[kept_t] = self.row_features[kept_rows_t]
        input_ids = step.input_ids[ids_t]
        positions, metadata = step.kv.runs(np.arange(len(rows)), step.num_computed - continues, counts)
        if self.step_graphs is None or self.step_graphs.run_step(input_ids, positions, metadata) is None:
            with set_forward_context(metadata):
                self.model(input_ids, positions, self.head_features[:num_tokens])
        self.row_features[rows_t] = features[last_t]
        self.row_request.update(zip(rows.tolist(), step.request_ids))

    def step_model(self) -> nn.Module:
        return _HeadOverFeatures(self.model, self.head_features)

    def propose(self, batch: ProposalBatch) -> Proposals:
        start = batch.num_tokens - 2  # the last emitted token joins the head where the target's last kept one is
        counts, index, steps = self.guessing_steps(batch, start)
        if steps is None or self.step_features is None:
            return self.proposals(batch, np.zeros_like(counts), index[:0], None)
        kept_rows = batch.token_index[index] + batch.num_emitted[index] - 1
        parts = [batch.token_ids[index, start[index] + 1], kept_rows, batch.kv.rows[index]]
        flat = torch.from_numpy(np.concatenate(parts)).to(self.aux.device, non_blocking=True)
        tokens, kept_t, rows_t = flat.split([len(index)] * 3)
        features = self.step_features[kept_t]
        self.row_features[rows_t] = features  # the feature the next step's pass starts from
        return self.proposals(batch, counts, index, self.chain_guesses(tokens, features, steps))

    def guess(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        with set_forward_context(metadata):
            normed, features = self.model(tokens, positions, features)
        return self.model.to_target_ids(self.model.compute_logits(normed).argmax(dim=-1)), features

    def guess_state(self, num_requests: int) -> torch.Tensor:
        return self.row_features.new_empty(num_requests, self.row_features.shape[1])

    def _grow_rows(self, num_rows: int) -> None:
        if num_rows > self.row_features.shape[0]:
            grown = self.row_features.new_zeros(max(num_rows, 2 * self.row_features.shape[0]),
                                                self.row_features.shape[1])
            grown[:self.row_features.shape[0]] = self.row_features
            self.row_features = grown


class _HeadOverFeatures(nn.Module):
    """The head as the engine's graphs call a model, ``(input_ids, positions)``: its features
    come from ``features`` (filled before each pass)."""

    def __init__(self, head: nn.Module, features: torch.Tensor):
        super().__init__()
        self.head = head
        self.features = features

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(input_ids, positions, self.features[:input_ids.shape[0]])[0]
