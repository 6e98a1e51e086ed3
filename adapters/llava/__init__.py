"""The LLaVA adapter: ``LlavaForConditionalGeneration`` checkpoints in HF format, through hooks only.

- ``register_models``: the architecture name -> the lazy model class.
- ``load_model``: build the vision tower and projector here, the text decoder from whichever
  plugin registered ``text_config``'s architecture, and load any HF key layout.
- ``preprocess_request``: expand each ``<image>`` into the image's token rows, record the image.
- ``prepare_inputs``: encode the images a step needs (once each), scatter them into the embeddings.
- ``render_content_part``: a chat image part becomes the ``<image>`` placeholder.
- ``request_finished``: drop cached image embeddings no live request uses any more.
- ``claim_request_parameters``: it takes ``multi_modal_data["image"]``.

These hooks are model-scoped: they run only when a LLaVA checkpoint is served, so they never
check the architecture. The encoder cache is per engine (``encoder_cache(context)``). The
model, open_clip and the image code are imported only when a LLaVA checkpoint is served.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from hookllm import hookimpl
from hookllm.entrypoints.chat import RenderedContent
from hookllm.plugins.context import EngineContext, RequestParameters

if TYPE_CHECKING:
    from hookllm.adapters.llava.model import EncoderCache

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


def encoder_cache(context: EngineContext) -> EncoderCache:
    """This engine's :class:`hookllm.adapters.llava.model.EncoderCache` (made on first use)."""
    state = context.state_for(__name__)
    if not hasattr(state, "encoder_cache"):
        from hookllm.adapters.llava.model import EncoderCache

        state.encoder_cache = EncoderCache()
    return state.encoder_cache


@hookimpl
def load_model(model_config, device, dtype, registry, context):
    from hookllm.adapters.llava.model import text_architecture
    from hookllm.worker.model_loader import building_on, iterate_weights

    hf_config = model_config.hf_config
    model_cls = registry.resolve(ARCHITECTURE, model_config.plugin)
    # The decoder's class by the same rule as a checkpoint's: a selected plugin wins a conflict.
    text_arch = text_architecture(hf_config.text_config)
    text_model_cls = registry.resolve(text_arch, registry.owner(text_arch, context.config.plugins))
    with building_on(device, dtype):
        model = model_cls(hf_config, text_model_cls)
    model.load_weights(iterate_weights(model_config.path))
    return model.eval()


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
def preprocess_request(request, tokenizer, model_config):
    data = request.multi_modal_data or {}
    unsupported = set(data) - {"image"}
    if unsupported:
        raise ValueError(f"request {request.request_id}: LLaVA takes only images, got {sorted(unsupported)}")
    from hookllm.adapters.llava.model import image_feature_size
    from hookllm.adapters.llava.processing import expand_request

    hf_config = model_config.hf_config
    processor = _image_processor(model_config.path, hf_config.vision_config.image_size)
    expand_request(request, tokenizer, hf_config.image_token_index, image_feature_size(hf_config), processor)


@hookimpl
def prepare_inputs(batch, inputs, model, context):
    # (flat row, request, item, first and last+1 image row) for each image slice in this step.
    slices = []
    for i, (request, count) in enumerate(zip(batch.requests, batch.num_scheduled_tokens)):
        start, end = request.num_computed_tokens, request.num_computed_tokens + count
        for item in request.mm_items:
            lo, hi = max(start, item.offset), min(end, item.offset + item.length)
            if item.modality == "image" and lo < hi:
                slices.append((inputs.query_start[i] + lo - start, request, item, lo - item.offset, hi - item.offset))
    if not slices:
        return
    cache = encoder_cache(context)
    missing = {item.content_hash: item for _, _, item, _, _ in slices if item.content_hash not in cache}
    if missing:
        pixels = torch.stack([item.data for item in missing.values()]).to(inputs.input_ids.device)
        for content_hash, embeddings in zip(missing, model.get_image_features(pixels)):
            cache.add(content_hash, embeddings.clone())  # a view would keep the whole batch alive
    embeds = model.embed_tokens(inputs.input_ids)
    for row, request, item, first, last in slices:
        embeds[row:row + last - first] = cache.use(item.content_hash, request)[first:last].to(embeds.dtype)
    inputs.inputs_embeds = embeds


@hookimpl
def request_finished(request, context):
    if request.mm_items:
        encoder_cache(context).release(request)
