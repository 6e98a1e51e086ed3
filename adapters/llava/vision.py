"""LLaVA's CLIP vision tower: open_clip's VisionTransformer built from an HF ``CLIPVisionConfig``.

LLaVA reads hidden states of inner layers, never the pooled output, so the tower is cut after
the deepest layer it needs and has no final norm or projection head. HF CLIP weights are mapped
onto open_clip's names, with the separate q/k/v projections fused into ``in_proj``.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Iterable, Iterator

import torch
from open_clip.transformer import LayerNorm, QuickGELU, VisionTransformer
from torch import nn

from hookllm.worker.model_loader import load_weights_into

ACTIVATIONS = {"quick_gelu": QuickGELU, "gelu": nn.GELU}

# HF CLIP vision names (without the "vision_model." prefix) -> open_clip VisionTransformer names.
RENAMES = [
    (r"embeddings\.class_embedding", "vit.class_embedding"),
    (r"embeddings\.patch_embedding\.weight", "vit.conv1.weight"),
    (r"embeddings\.position_embedding\.weight", "vit.positional_embedding"),
    (r"pre_layrnorm\.", "vit.ln_pre."),
    (r"encoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"vit.transformer.resblocks.\1.attn.out_proj."),
    (r"encoder\.layers\.(\d+)\.layer_norm1\.", r"vit.transformer.resblocks.\1.ln_1."),
    (r"encoder\.layers\.(\d+)\.layer_norm2\.", r"vit.transformer.resblocks.\1.ln_2."),
    (r"encoder\.layers\.(\d+)\.mlp\.fc1\.", r"vit.transformer.resblocks.\1.mlp.c_fc."),
    (r"encoder\.layers\.(\d+)\.mlp\.fc2\.", r"vit.transformer.resblocks.\1.mlp.c_proj."),
]
QKV = re.compile(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)")
LAYER = re.compile(r"encoder\.layers\.(\d+)\.")


class CLIPVisionTower(nn.Module):
    """Runs the CLIP ViT up to the deepest requested layer; returns those layers' hidden states.

    ``feature_layers`` follow HF's ``vision_feature_layer``: index 0 is the embeddings after
    ``pre_layrnorm``, index i the output of layer i, negative indices count from the end.
    """

    def __init__(self, config: Any, feature_layers: list[int]):
        super().__init__()
        num_layers = config.num_hidden_layers
        for index in feature_layers:
            if not -(num_layers + 1) <= index <= num_layers:
                raise ValueError(f"vision_feature_layer {index} is out of range for {num_layers} vision layers")
        self.feature_layers = [index % (num_layers + 1) for index in feature_layers]
        self.depth = max(self.feature_layers)
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported CLIP hidden_act {config.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        mlp_ratio = config.intermediate_size / config.hidden_size
        if int(config.hidden_size * mlp_ratio) != config.intermediate_size:
            raise ValueError(f"CLIP intermediate_size {config.intermediate_size} is not a multiple open_clip can build")
        self.vit = VisionTransformer(
            image_size=config.image_size,
            patch_size=config.patch_size,
            width=config.hidden_size,
            layers=self.depth,
            heads=config.num_attention_heads,
            mlp_ratio=mlp_ratio,
            output_dim=config.hidden_size,
            act_layer=ACTIVATIONS[config.hidden_act],
            norm_layer=partial(LayerNorm, eps=config.layer_norm_eps),
        )
        # LLaVA takes hidden states before CLIP's final norm and never uses the pooled output.
        self.vit.ln_post = nn.Identity()
        self.vit.proj = None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[n, 3, H, W]`` -> ``[n, 1 + patches, hidden * len(feature_layers)]`` (CLS first)."""
        x = self.vit._embeds(pixel_values)  # open_clip: patches, CLS, positions, ln_pre
        states = {0: x}
        for index, block in enumerate(self.vit.transformer.resblocks, start=1):
            x = block(x)
            if index in self.feature_layers:
                states[index] = x
        return torch.cat([states[index] for index in self.feature_layers], dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF CLIP vision tensors (names without ``vision_model.``), skipping unused ones."""
        load_weights_into(self, _to_open_clip(w for w in weights if not self._unused(w[0])))

    def _unused(self, name: str) -> bool:
        """Tensors of layers past the deepest feature layer, the final norm, old position ids."""
        layer = LAYER.match(name)
        return (layer is not None and int(layer.group(1)) >= self.depth) or name.startswith(
            ("post_layernorm.", "embeddings.position_ids")
        )


def _to_open_clip(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename HF CLIP tensors to open_clip's and fuse each layer's q/k/v into ``in_proj``."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        qkv = QKV.fullmatch(name)
        if qkv is not None:
            layer, part, kind = qkv.groups()
            parts = pending.setdefault((layer, kind), {})
            parts[part] = tensor
            if len(parts) == 3:
                del pending[layer, kind]
                yield f"vit.transformer.resblocks.{layer}.attn.in_proj_{kind}", torch.cat([parts[p] for p in "qkv"])
            continue
        for pattern, replacement in RENAMES:
            if re.match(pattern, name):
                name = re.sub(pattern, replacement, name, count=1)
                break
        yield name, tensor
    if pending:
        missing = [
            f"encoder.layers.{layer}.self_attn.{p}_proj.{kind}"
            for (layer, kind), parts in pending.items() for p in "qkv" if p not in parts
        ]
        raise ValueError("checkpoint does not match CLIPVisionTower: missing tensors: " + ", ".join(missing))
