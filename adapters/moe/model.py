"""Native mixture-of-experts decoders: Qwen2-MoE (with its shared expert), Qwen3-MoE and Mixtral.

Each is the Llama-family decoder of :mod:`hookllm.adapters.llama.model` (Qwen2's qkv bias,
Qwen3's q/k norm, Mistral's sliding window) whose sparse layers swap the dense MLP for a
:class:`SparseMoeBlock`: a router replicated on every rank, then
:class:`~hookllm.layers.fused_moe.FusedMoE` (softmax over all experts, top k, renormalised as the
config says) and, for Qwen2-MoE, a shared expert gated per token.

Checkpoints load in either layout: one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``), as on
the hub and as transformers' ``save_pretrained`` writes them, or stacked per layer
(``mlp.experts.gate_up_proj`` ``[experts, 2 * inter, hidden]``, ``mlp.experts.down_proj``), the
layout transformers 5 holds in memory.

Parallelism: attention, the dense MLPs and the shared expert are tensor parallel as in the dense
adapter; the experts are either split the same way or, with ``enable_expert_parallel``, placed
whole on ranks (see ``core/layers/fused_moe.py`` and docs/models.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hookllm.adapters.llama.model import DecoderMLP, LlamaForCausalLM
from hookllm.distributed import tensor_model_parallel_all_reduce
from hookllm.layers.fused_moe import FusedMoE, expert_tensor_renamer

# Checkpoint projection names -> FusedMoE's gate/up/down shards.
QWEN_EXPERTS = expert_tensor_renamer({"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
MIXTRAL_EXPERTS = expert_tensor_renamer({"w1": "gate", "w3": "up", "w2": "down"})


class SparseMoeBlock(nn.Module):
    """Router, experts and (``shared_expert_size`` given) a shared expert scaled by
    ``sigmoid(shared_expert_gate(x))`` and added to the routed output. ``[tokens, hidden]`` in and
    out, summed over ranks by one all-reduce."""

    def __init__(self, config: Any, intermediate_size: int, renormalize: bool, shared_expert_size: int | None = None):
        super().__init__()
        num_experts = config.num_experts  # Mixtral's config maps it onto num_local_experts
        # A plain replicated Linear: under expert parallelism every rank must see every expert's
        # logit to pick a token's top k, and the router is too small to be worth splitting.
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        # With a shared expert, its partial sum joins the experts' before the layer's one all-reduce.
        shared = shared_expert_size is not None
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size, intermediate_size,
                                softmax_first=True, renormalize=renormalize, reduce_results=not shared)
        if shared:
            self.shared_expert = DecoderMLP(config, shared_expert_size, reduce_results=False)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            # The gate scales each rank's partial sum alike, so the sum of the scaled shares is the scaled sum.
            shared = self.shared_expert(hidden_states)
            out = tensor_model_parallel_all_reduce(out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared)
        return out


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """transformers' Qwen-MoE rule: every ``decoder_sparse_step``-th layer (counting from 1) is
    sparse, except those in ``mlp_only_layers``, which keep a dense MLP of ``intermediate_size``."""
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Qwen-MoE decoder: sparse layers chosen by :func:`is_sparse_layer`, experts of
    ``moe_intermediate_size``, top-k weights renormalised iff ``norm_topk_prob``."""

    supports_expert_parallel = True  # FusedMoE places whole experts per rank when asked
    has_shared_expert = False

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return super().make_mlp(config, layer_index)
        shared = config.shared_expert_intermediate_size if self.has_shared_expert else None
        return SparseMoeBlock(config, config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)),
                              shared)

    def rename_weight(self, name: str) -> tuple[str, str | None] | None:
        return QWEN_EXPERTS(name)


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    has_shared_expert = True

    @property
    def qkv_bias(self) -> bool:
        # Qwen2-MoE's config names the q/k/v bias ``qkv_bias`` (default on); read while
        # LlamaForCausalLM.__init__ builds attention, after it has set ``self.config``.
        return bool(getattr(self.config, "qkv_bias", True))


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    qk_norm = True


class MixtralForCausalLM(LlamaForCausalLM):
    """Mistral attention (its ``sliding_window`` on every layer when set) and a sparse block on
    every layer: experts of ``intermediate_size``, top-k weights always renormalised."""

    supports_expert_parallel = True

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, config.intermediate_size, renormalize=True)

    def rename_weight(self, name: str) -> tuple[str, str | None] | None:
        # The checkpoint's ``block_sparse_moe`` is the layer's ``mlp`` here, as in transformers 5.
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return MIXTRAL_EXPERTS(name) or (name, None)
