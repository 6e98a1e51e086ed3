"""EAGLE-3 heads for the Llama family, in their published checkpoint format.

An EAGLE-3 head (Li et al., 2025) is one decoder layer that predicts the target's next tokens
from the target's own features: at position p it reads the embedding of token p + 1 and ``g_p``,
the target's residual streams entering three of its layers at p, fused by ``fc``
(``[3 * hidden] -> [hidden]``). Its layer's attention takes both, normed and joined
(``2 * hidden`` inputs to q/k/v); the residual is ``g_p`` itself. Its next guess continues from
its own output before the final norm, in place of ``g``. It scores a draft vocabulary of its own
(``draft_vocab_size`` rows of ``lm_head``); ``d2t`` maps a draft id d to the target's
``d + d2t[d]``.

Checkpoint tensors: ``midlayer.*`` (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``), ``fc``, ``norm``,
``lm_head``, ``d2t`` and ``t2d`` (unused). The head shares the target's token embedding
(EAGLE-3 trains with it frozen, so a saved ``embed_tokens`` is the target's and is skipped).
Its config may name the target layers it reads (``eagle_aux_hidden_state_layer_ids``); else
layers 2, n / 2 and n - 3 of an n-layer target, as the published heads were trained.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from hookllm.adapters.llama.model import DecoderAttention, DecoderMLP, rope_settings
from hookllm.layers import ParallelLMHead, QKVParallelLinear, RMSNorm, get_rope
from hookllm.layers.linear import LoadedWeight, materialize
from hookllm.worker.model_loader import load_weights_into


class Eagle3Layer(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base, scaling = rope_settings(config)
        rotary = get_rope(head_dim, config.max_position_embeddings, base, scaling)
        self.self_attn = DecoderAttention(config, getattr(config, "attention_bias", False), False, rotary, None)
        # Its q/k/v read the embedding and the feature side by side.
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.self_attn.qkv_proj = QKVParallelLinear(2 * config.hidden_size, head_dim, config.num_attention_heads,
                                                    kv_heads, bias=getattr(config, "attention_bias", False))
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = getattr(config, "norm_before_residual", False)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,
                features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        hidden_states = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """``forward(input_ids, positions, features)`` -> (normed, before the norm): features are
    ``fuse``'d target streams or the head's own previous output before its norm. The token
    embedding is the target's (``share_embedding``)."""

    is_speculative_head = True  # served only as speculative_config's model, never alone

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, config.hidden_size)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None  # the target's

    def aux_layer_ids(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input streams it reads: its config's, or 2, n / 2 and n - 3."""
        layers = getattr(self.config, "eagle_aux_hidden_state_layer_ids", None)
        return tuple(layers) if layers else (2, target_layers // 2, target_layers - 3)

    def share_embedding(self, embedding: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The target's token embedding (a module or its ``embed_tokens`` method)."""
        self.embed_tokens = embedding

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's three streams ``[T, 3 * hidden]`` as the head's features ``[T, hidden]``."""
        return self.fc(aux_hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.midlayer(positions, self.embed_tokens(input_ids), features)
        return self.norm(hidden_states, residual)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (``to_target_ids`` maps its ids)."""
        return self.lm_head(hidden_states)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        def tensors() -> Iterable[tuple[str, LoadedWeight]]:
            for name, tensor in weights:
                if name == "d2t":  # a buffer, not a parameter
                    self.d2t.copy_(materialize(tensor))
                else:
                    yield name, tensor

        load_weights_into(self, tensors(), stacked=[
            (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", "gate"), (".gate_up_proj", ".up_proj", "up"),
        ], skip=lambda name: name in ("t2d", "embed_tokens.weight") or "rotary_emb.inv_freq" in name)
