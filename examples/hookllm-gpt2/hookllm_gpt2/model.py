"""GPT-2 on hookllm's paged attention: learned positions, pre-LayerNorm blocks, tanh GELU, tied head.

Module names follow the HF checkpoint (``transformer.h.0.attn.c_attn``...), so loading is a
name-for-name copy, except that GPT-2's ``Conv1D`` weights are stored ``[in, out]`` and are
transposed into ``nn.Linear``'s ``[out, in]``.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hookllm.layers import Attention
from hookllm.worker.model_loader import load_weights_into

CONV1D_LAYERS = (".c_attn.", ".c_proj.", ".c_fc.")
# Causal-mask buffers some transformers versions saved with the weights.
SKIPPED_BUFFERS = (".attn.bias", ".attn.masked_bias")

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        hidden = config.n_embd
        head_dim = hidden // config.n_head
        scale = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.attn = Attention(config.n_head, head_dim, scale)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(hidden_states).chunk(3, dim=-1)
        return self.c_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.c_proj = nn.Linear(inner, config.n_embd)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = inputs_embeds + self.wpe(positions)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    """The hookllm model contract over GPT-2; the LM head is the token embedding (tied)."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        return self.transformer(inputs_embeds, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.transformer.wte.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights_into(
            self,
            _hf_to_linear(weights),
            # Tied head: a saved lm_head.weight is a copy of wte; old checkpoints lack the prefix.
            skip=lambda name: name.endswith(SKIPPED_BUFFERS) or name == "lm_head.weight",
        )


def _hf_to_linear(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Prefix bare ``GPT2Model`` names with ``transformer.`` and transpose Conv1D weights."""
    for name, tensor in weights:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(".weight") and any(layer in name for layer in CONV1D_LAYERS):
            tensor = tensor.t()
        yield name, tensor
