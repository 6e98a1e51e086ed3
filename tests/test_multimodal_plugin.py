"""A second vision-language family plugs in without touching the core: a test-local VipLlava
plugin (tests/multimodal_vipllava_plugin.py), installed through an entry point, answers as
transformers' VipLlavaForConditionalGeneration does on the same tiny random weights."""

import sys

import pytest
import torch
from llava_fixtures import random_image
from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaProcessor, VipLlavaConfig

from hookllm import LLM, testing
from hookllm.adapters.llava import make_tiny

PLUGIN = "multimodal_vipllava_plugin"
PROMPT = "USER: <image> compare <image> two images ASSISTANT:"
IMAGES = [random_image(40, 30, seed=1), random_image(25, 50, seed=2)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """CLIP tower of 3 layers read at layers -1 and 1 (16 rows an image), two-layer Llama decoder."""
    vision = CLIPVisionConfig(image_size=make_tiny.IMAGE_SIZE, patch_size=make_tiny.PATCH_SIZE, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, initializer_range=0.2)
    text = LlamaConfig(vocab_size=make_tiny.VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    config = VipLlavaConfig(vision_config=vision, text_config=text, image_token_index=make_tiny.IMAGE_TOKEN_ID,
                            vision_feature_layers=[-1, 1])
    path = tmp_path_factory.mktemp("vipllava")
    testing.build_tiny_checkpoint(config, path, model_cls=AutoModelForImageTextToText)
    make_tiny.save_tokenizer(path)
    make_tiny.image_processor().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """The plugin's module behind a ``*.dist-info`` entry point, as pip would install it."""
    site = tmp_path_factory.mktemp("site")
    dist_info = site / f"{PLUGIN}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[hookllm.plugins]\nvipllava = {PLUGIN}\n")
    sys.path.insert(0, str(site))
    yield "vipllava"
    sys.path.remove(str(site))


def make_llm(path, plugin, **kwargs):
    return LLM(str(path), plugins=[plugin], dtype="float32", device="cpu", **kwargs)


def reference_greedy(path, prompt, images, max_tokens):
    """transformers' expansion, pixels and greedy continuation for the checkpoint."""
    processor = LlavaProcessor(image_processor=make_tiny.image_processor(), tokenizer=make_tiny.save_tokenizer(path),
                               patch_size=make_tiny.PATCH_SIZE, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token="<image>")
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    model = testing.load_reference(path, model_cls=AutoModelForImageTextToText)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_greedy_tokens_equal_transformers_with_images_cut_across_steps(checkpoint, installed_plugin):
    llm = make_llm(checkpoint, installed_plugin, max_num_batched_tokens=7)  # each image over three chunks
    output = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": IMAGES}}, testing.greedy(12))[0]
    expected = reference_greedy(checkpoint, PROMPT, IMAGES, 12)
    assert len(set(expected)) > 1, "the reference output is constant: raise initializer_range"
    assert output.outputs[0].token_ids == expected


def test_the_core_encodes_each_image_once_and_frees_it(checkpoint, installed_plugin, monkeypatch):
    llm = make_llm(checkpoint, installed_plugin, max_num_batched_tokens=7)
    model = llm.engine.engine_core.executor.model
    encoded = []
    original = model.embed_multimodal
    monkeypatch.setattr(model, "embed_multimodal", lambda items: encoded.append(len(items)) or original(items))
    request = {"prompt": PROMPT, "multi_modal_data": {"image": [IMAGES[0], IMAGES[0]]}}
    llm.generate([request, request], testing.greedy(2))
    assert encoded == [1]  # one distinct image, cut across steps and shared by two requests
    assert len(llm.engine.engine_core.executor.runner.encoder.cache) == 0
