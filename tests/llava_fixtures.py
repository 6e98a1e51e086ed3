"""A tiny random LLaVA checkpoint (CLIP tower + Llama decoder with GQA), its tokenizer and images,
plus the transformers reference pipeline (LlavaProcessor + LlavaForConditionalGeneration)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    CLIPImageProcessorPil,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from hookllm import testing
from hookllm.adapters.llava import make_tiny
from hookllm.adapters.llava.make_tiny import (IMAGE_SIZE, IMAGE_TOKEN_ID, PATCH_SIZE, VOCAB_SIZE,  # noqa: F401
                                              WORDS, save_checkpoint, save_tokenizer, tiny_llava_config)
from hookllm.engine.core_request import EngineCoreRequest
from hookllm.sched.request import Request
from hookllm.sampling_params import SamplingParams


def image_processor(path: Path | None = None, **kwargs) -> CLIPImageProcessorPil:
    """transformers' PIL CLIP preprocessing for this checkpoint (shortest edge, then center crop)."""
    if path is not None and (path / "preprocessor_config.json").exists():
        return CLIPImageProcessorPil.from_pretrained(path, **kwargs)
    return make_tiny.image_processor(**kwargs)


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def reference_processor(path: Path, config: LlavaConfig) -> LlavaProcessor:
    """transformers' own prompt expansion and pixel preprocessing for the checkpoint."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return LlavaProcessor(image_processor=image_processor(path), tokenizer=tokenizer, patch_size=PATCH_SIZE,
                          vision_feature_select_strategy=config.vision_feature_select_strategy,
                          num_additional_image_tokens=1, image_token="<image>")


def load_reference(path: Path) -> LlavaForConditionalGeneration:
    return testing.load_reference(path, model_cls=AutoModelForImageTextToText)


def reference_inputs(path: Path, prompt: str, images: list[Image.Image], **text_kwargs) -> dict[str, torch.Tensor]:
    """transformers' model inputs (expanded ids, pixel values) for a prompt and its images."""
    processor = reference_processor(path, LlavaConfig.from_pretrained(path))
    return dict(processor(text=prompt, images=images or None, return_tensors="pt", **text_kwargs))


def reference_greedy(model: LlavaForConditionalGeneration, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, ignoring EOS."""
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def encoder_cache(engine):
    """The engine's encoder cache: the core's, in its in-process model runner."""
    return engine.engine_core.executor.runner.encoder.cache


def prompt_logits_chunked(llm, prompt: str, images: list[Image.Image], chunk: int) -> torch.Tensor:
    """hookllm's logits at every prompt position, prefilled ``chunk`` tokens at a time through the
    engine's hooks (preprocess_request) and model runner (its encoder cache included)."""
    engine = llm.engine
    core_request = EngineCoreRequest("logits", engine.tokenizer(prompt)["input_ids"], SamplingParams(), prompt=prompt,
                                     multi_modal_data={"image": images})
    engine.hooks.hook.preprocess_request(request=core_request, context=engine.hooks.context)
    request = Request.from_core_request(core_request)
    logits = []
    try:
        while request.num_computed_tokens < request.num_tokens:
            count = min(chunk, request.num_tokens - request.num_computed_tokens)
            logits.append(testing.forward_chunk(engine, request, count, logits=True))
    finally:
        testing.release_chunked(engine, request)
    return torch.cat(logits)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random LLaVA with a word-level tokenizer, saved once per test module."""
    return save_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)
