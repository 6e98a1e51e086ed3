"""LLaVA: a CLIP vision tower and a projector in front of any registered text decoder.

The text decoder is whatever class the registry holds for ``text_config``'s architecture (the
Llama adapter's for LLaVA-1.5), so it brings its own paged ``Attention`` layers and weight
loading; the core's default loader passes it in (:class:`SupportsMultiModal`), runs
``embed_multimodal`` once per distinct image and keeps the embeddings while a live request uses them.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from transformers.activations import ACT2FN

from hookllm.adapters.llava.vision import CLIPVisionTower
from hookllm.layers.linear import materialize
from hookllm.plugins.contract import Placeholder, SupportsMultiModal
from hookllm.sched.request import MultiModalItem
from hookllm.worker.model_loader import load_weights_into

TOP_LEVEL = ("language_model.", "vision_tower.", "multi_modal_projector.")


def feature_layers(config: Any) -> list[int]:
    """``vision_feature_layer`` as a list (an int selects one layer)."""
    layers = config.vision_feature_layer
    return [layers] if isinstance(layers, int) else list(layers)


def image_feature_size(config: Any) -> int:
    """Embedding rows per image: one per patch, plus the CLS token for the "full" strategy."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if config.vision_feature_select_strategy == "full" else 0)


def canonical_name(name: str) -> str:
    """Map every HF LLaVA key layout onto one: ``language_model.{model.*,lm_head.*}``,
    ``vision_tower.*`` (CLIP names without ``vision_model.``) and ``multi_modal_projector.*``.

    Layouts: original (``language_model.model.*``, ``vision_tower.vision_model.*``), transformers
    4.52+ (``model.language_model.*``, ``model.vision_tower.vision_model.*``, ``lm_head.*``) and
    transformers 5 (``language_model.model.*``, ``vision_tower.*``).
    """
    if name.startswith("model.") and name.removeprefix("model.").startswith(TOP_LEVEL):
        name = name.removeprefix("model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("language_model.") and not name.startswith(("language_model.model.", "language_model.lm_head.")):
        return "language_model.model." + name.removeprefix("language_model.")
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name.removeprefix("vision_tower.vision_model.")
    return name


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        in_features = config.vision_config.hidden_size * len(feature_layers(config))
        hidden = config.text_config.hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(nn.Module, SupportsMultiModal):
    # Under tensor parallelism the text decoder is sharded by its own parallel layers (they read
    # their slices of the lazy tensors); the vision tower and projector are replicated.
    supports_tensor_parallel = True

    def __init__(self, config: Any, text_model_cls: type[nn.Module]):
        super().__init__()
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        self.config = config
        self.vision_tower = CLIPVisionTower(config.vision_config, feature_layers(config))
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.language_model = text_model_cls(config.text_config)

    @classmethod
    def placeholder(cls, hf_config: Any, modality: str) -> Placeholder:
        return Placeholder(hf_config.image_token_index, image_feature_size(hf_config))

    def embed_multimodal(self, items: Sequence[MultiModalItem]) -> torch.Tensor:
        pixels = torch.stack([item.data for item in items])
        return self.get_image_features(pixels.to(self.multi_modal_projector.linear_1.weight.device))

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[n, 3, H, W]`` pixels -> ``[n, image_feature_size, text hidden]`` embeddings."""
        features = self.vision_tower(pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype))
        if self.config.vision_feature_select_strategy == "default":
            features = features[:, 1:]  # drop CLS
        return self.multi_modal_projector(features)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load any HF key layout; the text decoder's tensors stream through its own loader, the
        tower's and projector's are read whole at once (a lazy slice is valid only until the next)."""
        vision: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []
        unexpected: list[str] = []

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                canonical = canonical_name(name)
                if canonical.startswith("language_model."):
                    yield canonical.removeprefix("language_model."), tensor
                elif canonical.startswith("vision_tower."):
                    vision.append((canonical.removeprefix("vision_tower."), materialize(tensor)))
                elif canonical.startswith("multi_modal_projector."):
                    projector.append((canonical.removeprefix("multi_modal_projector."), materialize(tensor)))
                else:
                    unexpected.append(name)

        self.language_model.load_weights(text_weights())
        if unexpected:
            raise ValueError(f"checkpoint does not match {type(self).__name__}: unexpected tensors: "
                             + ", ".join(sorted(unexpected)))
        self.vision_tower.load_weights(vision)
        load_weights_into(self.multi_modal_projector, projector)
