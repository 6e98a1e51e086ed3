"""The LLaVA model served by hookllm equals transformers' LlavaForConditionalGeneration (fp32, CPU)."""

import pytest
import torch
from llava_fixtures import (  # noqa: F401 - checkpoint and reference are fixtures
    checkpoint,
    reference,
    load_reference,
    prompt_logits_chunked,
    random_image,
    reference_greedy,
    reference_inputs,
    save_checkpoint,
    tiny_llava_config,
)
from safetensors.torch import load_file, save_file

from hookllm import LLM, testing

ONE_IMAGE = "USER: <image> What is this? ASSISTANT:"  # 25 tokens, image rows 3..18
TWO_IMAGES = "USER: <image> compare <image> two images ASSISTANT:"
IMAGES = [random_image(40, 30, seed=1), random_image(25, 50, seed=2)]


def make_llm(path, **kwargs):
    return LLM(str(path), plugins=["llava"], dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def chunked_llm(checkpoint):
    """A token budget of 7: every image is prefilled over three chunks, each covering part of it."""
    return make_llm(checkpoint, max_num_batched_tokens=7)


def expected_greedy(reference, checkpoint, prompt, images, max_tokens=12):
    expected = reference_greedy(reference, reference_inputs(checkpoint, prompt, images), max_tokens)
    assert len(set(expected)) > 1, "the reference output is constant: raise initializer_range"
    return expected


def generate(llm, prompt, images, max_tokens=12):
    request = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    return llm.generate(request, testing.greedy(max_tokens))[0].outputs[0].token_ids


@pytest.mark.parametrize("overrides", [
    {"vision_feature_select_strategy": "default"},
    {"vision_feature_select_strategy": "full"},
    {"vision_feature_layer": [-3, 1, -1]},
    {"vision_feature_layer": 0, "vision_feature_select_strategy": "full"},
], ids=["default", "full", "layer-list", "embeddings-layer"])
def test_image_features_equal_transformers(tmp_path, overrides):
    path = save_checkpoint(tmp_path, tiny_llava_config(**overrides))
    reference = load_reference(path)
    pixels = reference_inputs(path, "<image>", IMAGES[:1])["pixel_values"]
    with torch.inference_mode():
        # Asked explicitly: with vision_feature_layer=0, transformers 5.24 otherwise gets no hidden states.
        theirs = reference.get_image_features(pixels, output_hidden_states=True).pooler_output[0]
        ours = make_llm(path).engine.engine_core.executor.model.get_image_features(pixels)[0]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() < 1e-5


def test_vision_tower_runs_only_the_layers_it_reads(tmp_path):
    path = save_checkpoint(tmp_path, tiny_llava_config(vision_feature_layer=-2))  # of 3 layers
    tower = make_llm(path).engine.engine_core.executor.model.vision_tower
    assert len(tower.vit.transformer.resblocks) == 2


@pytest.mark.parametrize("prompt,images", [(ONE_IMAGE, IMAGES[:1]), (TWO_IMAGES, IMAGES)], ids=["one", "two"])
def test_chunked_prefill_logits_equal_transformers(chunked_llm, reference, checkpoint, prompt, images):
    ours = prompt_logits_chunked(chunked_llm, prompt, images, chunk=5)
    with torch.inference_mode():
        theirs = reference(**reference_inputs(checkpoint, prompt, images)).logits[0]
    assert (ours - theirs).abs().max() < testing.LOGITS_ATOL


@pytest.mark.parametrize("prompt,images", [(ONE_IMAGE, IMAGES[:1]), (TWO_IMAGES, IMAGES)], ids=["one", "two"])
def test_greedy_tokens_equal_transformers_with_chunked_prefill(chunked_llm, reference, checkpoint, prompt, images):
    assert generate(chunked_llm, prompt, images) == expected_greedy(reference, checkpoint, prompt, images)


def test_image_and_text_only_requests_batch_together(chunked_llm, reference, checkpoint):
    prompts = [(ONE_IMAGE, IMAGES[:1]), ("USER: describe a red dog ASSISTANT:", []), (TWO_IMAGES, IMAGES)]
    requests = [{"prompt": p, "multi_modal_data": {"image": i}} if i else p for p, i in prompts]
    outputs = chunked_llm.generate(requests, testing.greedy(12))
    for (prompt, images), output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == expected_greedy(reference, checkpoint, prompt, images)
    testing.assert_all_blocks_free(chunked_llm)


def to_layout(checkpoint, target, layout):
    """A copy of the checkpoint with its tensors renamed to another transformers version's layout."""
    def rename(name):
        if layout == "4.x":  # original llava-hf: language_model.{model,lm_head}.*, vision_tower.vision_model.*
            return name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if layout == "4.52":  # model.{language_model,vision_tower.vision_model,multi_modal_projector}.*, lm_head.*
            name = name.replace("vision_tower.", "model.vision_tower.vision_model.", 1)
            name = name.replace("language_model.model.", "model.language_model.", 1)
            name = name.replace("multi_modal_projector.", "model.multi_modal_projector.", 1)
            return name.replace("language_model.lm_head.", "lm_head.", 1)
        return name  # as transformers 5 saves it
    for source in checkpoint.iterdir():
        if source.name != "model.safetensors":
            (target / source.name).write_bytes(source.read_bytes())
    save_file({rename(k): v for k, v in load_file(checkpoint / "model.safetensors").items()},
              target / "model.safetensors")
    return target


@pytest.mark.parametrize("layout", ["5.x", "4.x", "4.52"])
def test_every_checkpoint_key_layout_loads(tmp_path, checkpoint, reference, layout):
    llm = make_llm(to_layout(checkpoint, tmp_path, layout), max_num_batched_tokens=7)
    assert generate(llm, ONE_IMAGE, IMAGES[:1]) == expected_greedy(reference, checkpoint, ONE_IMAGE, IMAGES[:1])


def test_missing_and_unexpected_tensors_are_named(tmp_path, checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["multi_modal_projector.extra.weight"] = tensors.pop("multi_modal_projector.linear_2.bias")
    for source in checkpoint.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors: linear_2\.bias; unexpected tensors: extra\.weight"):
        make_llm(tmp_path)


def test_unpaired_attention_projection_is_named(tmp_path, checkpoint):
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["vision_tower.encoder.layers.0.self_attn.k_proj.weight"]
    for source in checkpoint.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"encoder\.layers\.0\.self_attn\.k_proj\.weight"):
        make_llm(tmp_path)
