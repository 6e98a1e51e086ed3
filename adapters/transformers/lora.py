"""The transformers backend's projections for LoRA adapters: each decoder layer's q/k/v, o,
gate/up and down, the token embedding and the LM head, by the module names PEFT gives them, whether hookllm fused them
(:mod:`.kernels`: q/k/v and gate/up each one projection of several slices), left them as
transformers built them, or split them over tensor-parallel ranks (:mod:`.parallel`)."""

from __future__ import annotations

import re

from torch import nn

from hookllm.adapters.transformers.kernels import FusedGatedMLP, FusedQKVAttention
from hookllm.lora.layers import ADAPTABLE, LoRAProjection

# A projection under a decoder layer's attention or MLP block (a fused attention module keeps
# transformers' own one, o_proj included, as its ``attention``).
_PROJECTION = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(?:attention\.)?(\w+)$")
_PEFT_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def lora_projections(causal_lm: nn.Module, decoder: nn.Module, decoder_path: str) -> list[LoRAProjection]:
    """The projections of ``decoder`` (at ``decoder_path`` in ``causal_lm``, as ``model``), its
    token embedding and the CausalLM's LM head, where they are plain ``nn.Embedding`` / ``nn.Linear``."""
    projections = []
    if isinstance(getattr(decoder, "embed_tokens", None), nn.Embedding):
        projections.append(LoRAProjection(decoder_path, decoder, "embed_tokens", ("embed_tokens",), kind="embedding"))
    head = causal_lm.get_output_embeddings()
    head_name = next((name for name, module in causal_lm.named_children() if module is head), None)
    if type(head) is nn.Linear and head_name is not None:
        projections.append(LoRAProjection("", causal_lm, head_name, (head_name,), kind="lm_head"))
    for name, module in decoder.named_modules():
        match = _PROJECTION.match(name)
        if match is None:
            continue
        layer, block, attr = match.groups()
        parent = decoder.get_submodule(name.rpartition(".")[0])
        prefix = f"{decoder_path}.layers.{layer}.{block}"
        if isinstance(parent, FusedQKVAttention) and attr == "qkv_proj":
            projections.append(LoRAProjection(prefix, parent, attr, ("q_proj", "k_proj", "v_proj"),
                                              tuple(parent.sizes)))
        elif isinstance(parent, FusedGatedMLP) and attr == "gate_up":
            half = module.out_features // 2
            projections.append(LoRAProjection(prefix, parent, attr, ("gate_proj", "up_proj"), (half, half)))
        elif attr in _PEFT_NAMES and isinstance(module, (nn.Linear, *ADAPTABLE)):
            projections.append(LoRAProjection(prefix, parent, attr, (attr,)))
    return projections
