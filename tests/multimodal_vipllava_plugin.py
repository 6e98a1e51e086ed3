"""A second vision-language family as a plugin, outside the core: VipLlava (a CLIP tower read at
several layers, a layer-normed projector, any registered text decoder).

Installed by tests/test_multimodal_plugin.py through an entry point, as a pip-installed plugin
would be. The plugin gives what :class:`hookllm.plugins.contract.SupportsMultiModal` asks (its
encoder, its placeholder, weight loading) and a ``preprocess_request`` that expands the prompt;
the core builds the model around its text decoder, runs the encoder once per distinct image,
keeps the embeddings while a request uses them and merges each step's rows.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable, Sequence

import torch
from torch import nn
from transformers import CLIPImageProcessor, CLIPVisionModel
from transformers.activations import ACT2FN

from hookllm import hookimpl
from hookllm.multimodal import expand_placeholders
from hookllm.plugins.context import RequestParameters
from hookllm.plugins.contract import Placeholder, SupportsMultiModal
from hookllm.sched.request import MultiModalItem
from hookllm.worker.model_loader import load_weights_into

ARCHITECTURE = "VipLlavaForConditionalGeneration"


@hookimpl
def register_models(registry):
    registry.register(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")


@hookimpl
def claim_request_parameters():
    return RequestParameters(modalities=("image",))


@lru_cache(maxsize=4)
def image_processor(model_dir: str) -> CLIPImageProcessor:
    return CLIPImageProcessor.from_pretrained(model_dir)


@hookimpl
def preprocess_request(request, context):
    """The prompt's token ids already hold one image token per image (the tokenizer knows it)."""
    images = (request.multi_modal_data or {}).get("image", [])
    model_config = context.model_config
    placeholder = VipLlavaForConditionalGeneration.placeholder(model_config.hf_config, "image")
    if request.prompt_token_ids.count(placeholder.token_id) != len(images):
        raise ValueError(f"request {request.request_id}: one image token per image, please")
    if images:
        pixels = list(image_processor(model_config.path)(images=images, return_tensors="pt")["pixel_values"])
        ids, items = expand_placeholders(request.prompt_token_ids, "image", placeholder, pixels)
        request.mm_items.extend(items)
        request.reset_prompt(ids)


class VipLlavaProjector(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        in_features = config.vision_config.hidden_size * len(config.vision_feature_layers)
        hidden = config.text_config.hidden_size
        self.projector_layernorm = nn.LayerNorm(in_features, eps=config.projector_layernorm_eps)
        self.linear_1 = nn.Linear(in_features, hidden)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.projector_layernorm(features))))


class VipLlavaForConditionalGeneration(nn.Module, SupportsMultiModal):
    def __init__(self, config: Any, text_model_cls: type[nn.Module]):
        super().__init__()
        self.config = config
        self.vision_tower = CLIPVisionModel(config.vision_config)
        self.multi_modal_projector = VipLlavaProjector(config)
        self.language_model = text_model_cls(config.text_config)

    @classmethod
    def placeholder(cls, hf_config: Any, modality: str) -> Placeholder:
        vision = hf_config.vision_config
        return Placeholder(hf_config.image_token_index, (vision.image_size // vision.patch_size) ** 2)

    def embed_multimodal(self, items: Sequence[MultiModalItem]) -> torch.Tensor:
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack([item.data for item in items]).to(weight.device, weight.dtype)
        states = self.vision_tower(pixels, output_hidden_states=True).hidden_states
        # Each selected layer's patch rows (CLS dropped), side by side.
        return self.multi_modal_projector(torch.cat([states[i][:, 1:] for i in self.config.vision_feature_layers], -1))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """transformers 5's layout: ``language_model.{model,lm_head}.*``, ``vision_tower.*``,
        ``multi_modal_projector.*``; the decoder's tensors stream through its own loader."""
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {"vision_tower.": [], "multi_modal_projector.": []}

        def text_weights():
            for name, tensor in weights:
                prefix = next((p for p in parts if name.startswith(p)), None)
                if prefix is None:
                    yield name.removeprefix("language_model."), tensor
                else:
                    parts[prefix].append((name.removeprefix(prefix), tensor))

        self.language_model.load_weights(text_weights())
        load_weights_into(self.vision_tower, parts["vision_tower."])
        load_weights_into(self.multi_modal_projector, parts["multi_modal_projector."])
