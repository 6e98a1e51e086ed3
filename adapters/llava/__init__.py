"""The LLaVA adapter: ``LlavaForConditionalGeneration`` checkpoints in HF format, through hooks only.

- ``register_models``: the architecture name -> the lazy model class, a
  :class:`hookllm.plugins.contract.SupportsMultiModal` model: the core's default ``load_model``
  builds it around the text decoder registered for ``text_config``, and the core's model runner
  runs its encoder (once per distinct image) and keeps the embeddings while a request uses them.
- ``preprocess_request``: expand each ``<image>`` into the image's token rows, record the image.
- ``render_content_part``: a chat image part becomes the ``<image>`` placeholder.
- ``claim_request_parameters``: it takes ``multi_modal_data["image"]``.

These hooks are model-scoped: they run only when a LLaVA checkpoint is served, so they never
check the architecture. The model, open_clip and the image code are imported only when a LLaVA
checkpoint is served.
"""

from __future__ import annotations

from functools import lru_cache

from hookllm import hookimpl
from hookllm.entrypoints.chat import RenderedContent
from hookllm.plugins.context import RequestParameters

ARCHITECTURE = "LlavaForConditionalGeneration"
# LLaVA-1.5's prompt placeholder: one per image, expanded into the image's token rows.
IMAGE_PLACEHOLDER = "<image>"
IMAGE_PART_KEYS = {"image_url": "image_url", "image": "image", "image_pil": "image_pil"}


@hookimpl
def register_models(registry):
    registry.register(ARCHITECTURE, f"hookllm.adapters.llava.model:{ARCHITECTURE}")


@hookimpl
def claim_request_parameters():
    return RequestParameters(modalities=("image",))


@hookimpl
def render_content_part(part):
    """An image part (``image_url`` with a URL or data URL, ``image`` / ``image_pil`` with a PIL
    image or a path) becomes the placeholder and joins ``multi_modal_data["image"]``."""
    key = IMAGE_PART_KEYS.get(part.get("type"))
    if key is None:
        return None
    image = part.get(key)
    if isinstance(image, dict):  # {"url": ...}, as OpenAI's image_url parts carry it
        image = image.get("url")
    if image is None:
        raise ValueError(f"a {part['type']!r} content part carries no image")
    return RenderedContent(IMAGE_PLACEHOLDER, {"image": [image]})


@lru_cache(maxsize=8)
def _image_processor(model_dir: str, image_size: int):
    from hookllm.adapters.llava.processing import ImageProcessor

    return ImageProcessor.from_pretrained(model_dir, image_size)


@hookimpl
def preprocess_request(request, context):
    data = request.multi_modal_data or {}
    unsupported = set(data) - {"image"}
    if unsupported:
        raise ValueError(f"request {request.request_id}: LLaVA takes only images, got {sorted(unsupported)}")
    from hookllm.adapters.llava.model import LlavaForConditionalGeneration
    from hookllm.adapters.llava.processing import expand_request

    model_config = context.model_config
    hf_config = model_config.hf_config
    processor = _image_processor(model_config.path, hf_config.vision_config.image_size)
    expand_request(request, context.tokenizer, LlavaForConditionalGeneration.placeholder(hf_config, "image"), processor)
