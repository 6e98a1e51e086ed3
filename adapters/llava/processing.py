"""Image preprocessing (pillow, exact to transformers' PIL CLIP/LLaVA image processors) and
placeholder expansion of prompts."""

from __future__ import annotations

import base64
import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from hookllm.adapters.llava import IMAGE_PLACEHOLDER
from hookllm.engine.core_request import EngineCoreRequest
from hookllm.multimodal import expand_placeholders
from hookllm.plugins.contract import Placeholder

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _height_width(value: Any) -> tuple[int, int] | None:
    """A preprocessor size as (height, width); None for a shortest-edge size."""
    if isinstance(value, int):
        return value, value
    if "height" in value:
        return value["height"], value["width"]
    return None


@dataclass
class ImageProcessor:
    """CLIP preprocessing: RGB, resize the shortest edge (bicubic), center crop, rescale, normalize.

    ``pad_to_square`` first pads the image to a square of the mean color (LLaVA's
    ``expand2square``, transformers' ``LlavaImageProcessor(do_pad=True)``).
    """

    shortest_edge: int | None = 224  # resize so the shorter side is this long ...
    resize_to: tuple[int, int] | None = None  # ... or to exactly (height, width)
    crop_size: tuple[int, int] = (224, 224)
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    pad_to_square: bool = False

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, image_size: int) -> "ImageProcessor":
        """Settings from ``preprocessor_config.json``; without one, CLIP's at the tower's image size."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.exists():
            return cls(shortest_edge=image_size, crop_size=(image_size, image_size))
        cfg = json.loads(path.read_text())
        size = cfg.get("size", {"shortest_edge": image_size})
        resize_to = _height_width(size)
        return cls(
            shortest_edge=None if resize_to else size["shortest_edge"],
            resize_to=resize_to,
            crop_size=_height_width(cfg.get("crop_size", {"height": image_size, "width": image_size})),
            image_mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
            image_std=tuple(cfg.get("image_std", CLIP_STD)),
            rescale_factor=cfg.get("rescale_factor", 1 / 255),
            resample=cfg.get("resample", Image.Resampling.BICUBIC),
            do_resize=cfg.get("do_resize", True),
            do_center_crop=cfg.get("do_center_crop", True),
            do_rescale=cfg.get("do_rescale", True),
            do_normalize=cfg.get("do_normalize", True),
            pad_to_square=bool(cfg.get("do_pad", False)),
        )

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """A PIL image -> float32 ``[3, height, width]`` pixel values."""
        image = image.convert("RGB")
        if self.pad_to_square:
            image = expand2square(image, tuple(int(x * 255) for x in self.image_mean))
        if self.do_resize:
            image = image.resize(self._resized_size(*image.size), resample=self.resample)
        if self.do_center_crop:
            # Same offsets as transformers' center_crop; pillow fills any out-of-image area with 0.
            height, width = self.crop_size
            top, left = (image.height - height) // 2, (image.width - width) // 2
            image = image.crop((left, top, left + width, top + height))
        # An RGB image holds 8-bit values: each output element is a lookup in a 256-entry table
        # per channel, the same float32 as the arithmetic on every pixel gives, several times faster.
        channels = np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))
        return torch.from_numpy(self._pixel_values[np.arange(3)[:, None, None], channels])

    @functools.cached_property
    def _pixel_values(self) -> np.ndarray:
        """``[3, 256]`` float32: each channel's output for each 8-bit value. Rescaled in float64
        then cast to float32, as transformers rescales; normalized in float32."""
        values = np.tile(np.arange(256, dtype=np.float64), (3, 1))
        values = (values * self.rescale_factor if self.do_rescale else values).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None]
            values = (values - mean) / std
        return values

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after resizing; the shortest-edge rule truncates the long side as transformers does."""
        if self.resize_to is not None:
            return self.resize_to[1], self.resize_to[0]
        short, long = sorted((width, height))
        new_long = int(self.shortest_edge * long / short)
        return (self.shortest_edge, new_long) if width <= height else (new_long, self.shortest_edge)


def expand2square(image: Image.Image, background: tuple[int, ...]) -> Image.Image:
    """Pad to a square of ``background`` color, the image centered (LLaVA's original helper)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    result = Image.new(image.mode, (side, side), background)
    result.paste(image, ((side - width) // 2, (side - height) // 2))
    return result


def load_image(image: Any, request_id: str) -> Image.Image:
    """A PIL image from a PIL image, a file path, encoded bytes or a base64 ``data:`` URL (as
    OpenAI-style ``image_url`` parts carry); ValueError if it can't be read."""
    try:
        if isinstance(image, Image.Image):
            return image
        if isinstance(image, str) and image.startswith("data:"):
            image = base64.b64decode(image.partition(",")[2], validate=True)
        if isinstance(image, (str, Path)):
            opened = Image.open(image)
        elif isinstance(image, (bytes, bytearray)):
            opened = Image.open(io.BytesIO(image))
        else:
            raise ValueError(f"expected a PIL image, a path, bytes or a data URL, got {type(image).__name__}")
        opened.load()
        return opened
    except (OSError, ValueError) as exc:  # binascii.Error is a ValueError
        raise ValueError(f"request {request_id}: cannot read image: {exc}") from exc


def placeholder_ids(request: EngineCoreRequest, tokenizer: Any, image_token_id: int) -> list[int]:
    """The prompt with one ``image_token_id`` per image placeholder.

    The core's tokens already hold them when the prompt was given as token ids or the tokenizer
    knows ``<image>`` (that whole-prompt tokenization is transformers' too). Otherwise the text
    is split on ``<image>`` and each piece tokenized, special tokens only before the first (and
    not at all when the text already starts with the BOS string, as chat-template output does).
    """
    ids = request.prompt_token_ids
    if image_token_id in ids or not request.prompt or IMAGE_PLACEHOLDER not in request.prompt:
        return list(ids)
    if tokenizer is None:
        raise ValueError(f"request {request.request_id}: no tokenizer to split the prompt on {IMAGE_PLACEHOLDER}")
    first, *rest = request.prompt.split(IMAGE_PLACEHOLDER)
    bos = getattr(tokenizer, "bos_token", None)
    with_special = not (bos and request.prompt.startswith(bos))
    ids = tokenizer(first, add_special_tokens=with_special)["input_ids"]
    for piece in rest:
        ids = ids + [image_token_id] + tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def expand_request(request: EngineCoreRequest, tokenizer: Any, placeholder: Placeholder,
                   processor: ImageProcessor) -> None:
    """Replace each placeholder by the image's ``placeholder.num_rows`` tokens and record the
    images in ``request.mm_items``; ValueError (naming the request) when images and placeholders disagree."""
    images = request.multi_modal_data.get("image", []) if request.multi_modal_data else []
    images = images if isinstance(images, (list, tuple)) else [images]
    ids = placeholder_ids(request, tokenizer, placeholder.token_id)
    num_placeholders = ids.count(placeholder.token_id)
    if num_placeholders != len(images):
        raise ValueError(
            f"request {request.request_id}: the prompt has {num_placeholders} {IMAGE_PLACEHOLDER} "
            f"placeholder(s) but {len(images)} image(s) were given"
        )
    if not images:
        return
    pixels = [processor(load_image(image, request.request_id)) for image in images]
    expanded, items = expand_placeholders(ids, "image", placeholder, pixels)
    request.mm_items.extend(items)
    request.reset_prompt(expanded)
