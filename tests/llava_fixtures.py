"""A tiny random LLaVA checkpoint (CLIP tower + Llama decoder with GQA), its tokenizer and images,
plus the transformers reference pipeline (LlavaProcessor + LlavaForConditionalGeneration)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForImageTextToText,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from hookllm import testing
from hookllm.sched.request import Request
from hookllm.sampling_params import SamplingParams

IMAGE_SIZE, PATCH_SIZE = 28, 7  # 16 patches: an image is 16 rows ("default") or 17 ("full")
VOCAB_SIZE = 100
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
WORDS = ["USER", ":", "ASSISTANT", "What", "is", "this", "?", "a", "cat", "dog", "and", "the", "describe",
         "picture", "compare", "two", "images", "red", "blue", "green"]


def tiny_llava_config(vision: dict | None = None, text: dict | None = None, **overrides) -> LlavaConfig:
    """The tiny LLaVA; ``vision`` / ``text`` override fields of the CLIP / Llama sub-configs."""
    vision_fields = dict(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, initializer_range=0.2)
    text_fields = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    return LlavaConfig(vision_config=CLIPVisionConfig(**{**vision_fields, **(vision or {})}),
                       text_config=LlamaConfig(**{**text_fields, **(text or {})}),
                       image_token_index=IMAGE_TOKEN_ID, **overrides)


def save_tokenizer(path: Path, knows_image: bool = True) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over exactly VOCAB_SIZE ids, BOS added; ``<image>`` is id 99 when known."""
    fillers = [f"w{i}" for i in range(VOCAB_SIZE - 4 - len(WORDS))]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *WORDS, *fillers, "<pad>"])}
    if knows_image:
        vocab["<image>"] = vocab.pop("<pad>")
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    extra = {"extra_special_tokens": ["<image>"]} if knows_image else {}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", **extra)
    tokenizer.save_pretrained(path)
    return tokenizer


def save_checkpoint(path: Path, config: LlavaConfig | None = None, seed: int = 0) -> Path:
    """Random weights, tokenizer and CLIP preprocessor config, saved as transformers saves them."""
    testing.build_tiny_checkpoint(config or tiny_llava_config(), path, seed=seed,
                                  model_cls=AutoModelForImageTextToText)
    save_tokenizer(path)
    image_processor(path).save_pretrained(path)
    return path


def image_processor(path: Path | None = None, **kwargs) -> CLIPImageProcessorPil:
    """transformers' PIL CLIP preprocessing for this checkpoint (shortest edge, then center crop)."""
    if path is not None and (path / "preprocessor_config.json").exists():
        return CLIPImageProcessorPil.from_pretrained(path, **kwargs)
    return CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, **kwargs)


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


def prompt_logits_chunked(llm, prompt: str, images: list[Image.Image], chunk: int) -> torch.Tensor:
    """hookllm's logits at every prompt position, prefilled ``chunk`` tokens at a time through the
    engine's hooks (preprocess_request, prepare_inputs, request_finished) and model runner."""
    engine = llm.engine
    request = Request("logits", engine.tokenizer(prompt)["input_ids"], SamplingParams(), prompt=prompt,
                      multi_modal_data={"image": images})
    engine.hooks.hook.preprocess_request(request=request, tokenizer=engine.tokenizer, model_config=engine.model_config)
    logits = []
    try:
        while request.num_computed_tokens < request.num_tokens:
            count = min(chunk, request.num_tokens - request.num_computed_tokens)
            hidden_states = testing.forward_chunk(engine, request, count)
            with torch.inference_mode():
                logits.append(engine.worker.model.compute_logits(hidden_states).float())
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
