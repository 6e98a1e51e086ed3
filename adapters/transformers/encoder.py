"""``TransformersEncoderModel``: a Hugging Face encoder (BERT, RoBERTa / XLM-R, ModernBERT...)
behind hookllm's model contract, for the pooling runner.

As for causal LMs (:mod:`.model`), transformers' own class is built with
``attn_implementation="hookllm"``: its attention modules call hookllm's paged attention, here
bidirectional (``causal=False``), and everything else (absolute, RoPE or RoBERTa-style
positions, token types, post-norm layers, ModernBERT's local attention) is transformers' code.
The flat batch goes in as one sequence; the paged attention keeps the sequences apart, which is
why an encoder's prompt is computed in one step (a chunk's queries would need later keys).

A ``*ForSequenceClassification`` checkpoint keeps transformers' head: :meth:`classify` runs the
classifier's forward with its encoder standing in for the prompt's hidden states, so it pools
(BERT's pooler over CLS, RoBERTa's head, ModernBERT's mean or CLS) as it was trained to.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import nn

from hookllm.adapters.transformers import attention, support
from hookllm.adapters.transformers.model import StandIn, compile_dynamic
from hookllm.adapters.transformers.weights import build_empty, load_checkpoint_tensors, materialize
from hookllm.config import position_offset
from hookllm.plugins.contract import SupportsClassification
from hookllm.worker.forward_context import get_forward_context


class TransformersEncoderModel(nn.Module, SupportsClassification):
    """A transformers encoder on hookllm's paged attention; built under ``building_on``. A
    classifier checkpoint's head runs in :meth:`classify`."""

    supports_torch_compile = True

    def __init__(self, config: Any):
        super().__init__()
        model_cls = support.model_class(config, encoder=True)
        config = copy.deepcopy(config)
        config.use_cache = False
        attention.register()
        dtype = torch.get_default_dtype()
        self.hf_model = build_empty(model_cls, config, dtype)
        support.check_structure(self.hf_model)
        materialize(self.hf_model, dtype)
        base = self.hf_model.base_model
        self._base_path = next(path for path, module in self.hf_model.named_modules() if module is base)
        self.position_offset = position_offset(config)
        # Token types (a pair's second text is type 1) where the encoder has more than one.
        self.uses_token_types = getattr(config, "type_vocab_size", 1) > 1
        specs = attention.probe(self.hf_model, self._probe_forward, causal=False)
        self.attention = nn.ModuleList(attention.PagedLayer(spec) for spec in specs)
        self._route = attention.PagedRoute(self.attention)
        self._stand_in = StandIn(getattr(base, "pooler", None))
        self._hidden_states = self._run_encoder  # compiled by use_torch_compile

    @property
    def encoder(self) -> nn.Module:
        """The transformers base model (the classifier's encoder, or the whole model)."""
        return self.hf_model.get_submodule(self._base_path) if self._base_path else self.hf_model

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf_model.get_input_embeddings()(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden state of every token (the encoder's final norm included)."""
        token_types = get_forward_context().token_type_ids if self.uses_token_types else None
        with attention.routed_to(self._route):
            return self._hidden_states(input_ids, positions, inputs_embeds, token_types)

    def _run_encoder(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None,
                     token_types: torch.Tensor | None) -> torch.Tensor:
        inputs = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        if token_types is not None:
            inputs["token_type_ids"] = token_types[None]
        return self.encoder(**inputs, position_ids=(positions + self.position_offset)[None])[0][0]

    def use_torch_compile(self, backend: str = "inductor") -> None:
        """Run the encoder through torch.compile (the worker calls this when CUDA graphs are on),
        as :meth:`.model.TransformersForCausalLM.use_torch_compile` does the decoder."""
        self._hidden_states = compile_dynamic(self._run_encoder, backend)

    def _probe_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self._run_encoder(input_ids, positions, None, None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self.hf_model).__name__} is an encoder: it has no LM head to sample from")

    @torch.inference_mode()
    def classify(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[prompt tokens, hidden]`` of one prompt -> its classifier's ``[labels]`` logits, by
        the transformers classifier's own forward over them."""
        parent, _, name = self._base_path.rpartition(".")
        return self._stand_in.run(self.hf_model, self.hf_model.get_submodule(parent), name,
                                  hidden_states[None].to(self.hf_model.dtype), return_dict=True).logits[0]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_checkpoint_tensors(self.hf_model, weights)

