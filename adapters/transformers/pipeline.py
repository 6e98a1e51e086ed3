"""Pipeline stages of a transformers decoder.

transformers' decoder forward runs every layer, with whatever each model does around them
(embedding scales, learned positions, final norms); a stage must run only its layers without
rewriting that forward per model. So every stage runs the decoder's own forward, cut at its
layers: the other stages' layers become :class:`OtherStageLayer` (no weights; each passes its
input on), a stage after the first feeds zeros as ``inputs_embeds`` (what the decoder makes of
them is discarded) and a hook on its first layer swaps in the hidden states the previous stage
sent, and on a stage before the last a hook on its last layer ends the forward with that layer's
output. transformers' decoder layers keep the residual inside, so a stage passes the next one
tensor, ``[1, num_tokens, hidden]``.

A stage keeps the input embedding where it runs it (the first) or its LM head shares it (the
last, with tied embeddings), and the LM head on the last stage only.
"""

from __future__ import annotations

import torch
from torch import nn

from hookllm.adapters.transformers.support import Unsupported
from hookllm.distributed import is_first_stage, is_last_stage, stage_layer_range
from hookllm.layers import StageMissing


class OtherStageLayer(StageMissing):
    """A decoder layer another stage runs (its weights are skipped as a ``StageMissing``'s are):
    returns its input hidden states, which the stage's own first layer replaces by what the
    previous stage sent."""

    def forward(self, *args: object, **kwargs: object) -> object:
        return args[0] if args else kwargs["hidden_states"]


class _StageEnd(Exception):
    """Raised by the last layer of a stage before the last, carrying its output hidden states."""

    def __init__(self, hidden_states: torch.Tensor):
        super().__init__()
        self.hidden_states = hidden_states


class StageCut:
    """One stage's part of a transformers CausalLM (built on the meta device), and how its
    decoder forward runs only that part. :class:`Unsupported` where the decoder has no single
    list of ``num_hidden_layers`` layers."""

    def __init__(self, model: nn.Module, decoder: nn.Module, num_layers: int):
        layers = _decoder_layers(model, decoder, num_layers)
        self.start, self.end = stage_layer_range(num_layers)
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        embedding = model.get_input_embeddings()
        self.embedding_dim = embedding.embedding_dim
        for index in range(num_layers):
            if not self.start <= index < self.end:
                layers[index] = OtherStageLayer()
        tied = getattr(model.config, "tie_word_embeddings", False)
        if not (self.is_first or (self.is_last and tied)):
            _replace(model, embedding, StageMissing())
        if not self.is_last:
            _replace(model, model.get_output_embeddings(), StageMissing())
        if tied and not self.is_last:
            model.config.tie_word_embeddings = False  # the head this stage lacks ties to nothing
        self.incoming: torch.Tensor | None = None
        if not self.is_first:
            layers[self.start].register_forward_pre_hook(self._take_incoming, with_kwargs=True)
        if not self.is_last:
            layers[self.end - 1].register_forward_hook(self._end_stage)

    def run(self, decoder_forward, input_ids: torch.Tensor, positions: torch.Tensor,
            inputs_embeds: torch.Tensor | None, intermediate: torch.Tensor | None) -> torch.Tensor:
        """``decoder_forward(input_ids, positions, inputs_embeds)`` on this stage's layers: the
        last stage's hidden states, or ``[1, num_tokens, hidden]`` for the next stage."""
        if intermediate is not None:
            self.incoming = intermediate[0][None]
            inputs_embeds = intermediate.new_zeros(positions.shape[0], self.embedding_dim)
        try:
            hidden_states = decoder_forward(input_ids, positions, inputs_embeds)
        except _StageEnd as end:
            return end.hidden_states
        finally:
            self.incoming = None
        return hidden_states

    def _take_incoming(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (self.incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.incoming}

    def _end_stage(self, module: nn.Module, args: tuple, output: object) -> None:
        hidden_states = output if isinstance(output, torch.Tensor) else output[0]
        raise _StageEnd(hidden_states)


def _decoder_layers(model: nn.Module, decoder: nn.Module, num_layers: int) -> nn.ModuleList:
    lists = [child for child in decoder.children() if isinstance(child, nn.ModuleList) and len(child) == num_layers]
    if len(lists) != 1:
        raise Unsupported(f"{type(model).__name__}: its decoder has no single list of its {num_layers} layers to "
                          "split into pipeline stages")
    return lists[0]


def _replace(model: nn.Module, module: nn.Module, replacement: nn.Module) -> None:
    """Put ``replacement`` where ``module`` sits in ``model``."""
    path = next(p for p, m in model.named_modules() if m is module)
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, replacement)
