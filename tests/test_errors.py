"""Bad input fails alone with a ValueError that names the problem; the LLM keeps serving."""

import pytest
from safetensors.torch import load_file, save_file

from hookllm import LLM, SamplingParams, testing

GOOD = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=6)


@pytest.fixture(scope="module")
def expected_good(llm):
    return llm.generate(GOOD, testing.greedy(5))[0].outputs[0].token_ids


def _still_serves(llm, expected_good):
    assert llm.generate(GOOD, testing.greedy(5))[0].outputs[0].token_ids == expected_good
    testing.assert_all_blocks_free(llm)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [3] * 200}, "max_model_len is 128"),
    ({"prompt_token_ids": [3, 999999]}, "token ids must be in"),
])
def test_bad_prompt_raises_and_engine_keeps_serving(llm, expected_good, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD, prompt], testing.greedy(5))
    _still_serves(llm, expected_good)


def test_request_that_can_never_fit_in_the_kv_cache(llm, expected_good):
    # 6 blocks of 16 = 96 slots; 90 prompt tokens + 20 outputs need 7 blocks.
    with pytest.raises(ValueError, match="needs 7 KV blocks, but the cache has only 6"):
        llm.generate({"prompt_token_ids": [3] * 90}, testing.greedy(20))
    _still_serves(llm, expected_good)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"top_k": -5}, "top_k must be"),
])
def test_invalid_sampling_values_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_plugin_lists_the_installed_ones(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"unknown plugin 'nope'; installed plugins: .*llama"):
        LLM(str(tiny_llama_dir), plugins=["nope"], device="cpu")


def test_checkpoint_with_a_missing_tensor_names_it(tiny_llama_dir, tmp_path):
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises(ValueError) as info:
        LLM(str(tmp_path), device="cpu")
    assert "missing tensors: model.layers.1.mlp.gate_up_proj.weight [up]" in str(info.value)
    assert "unexpected tensors: model.layers.1.mlp.extra.weight" in str(info.value)


def test_pickle_checkpoints_are_refused(tiny_llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle checkpoints.*safetensors only"):
        LLM(str(tmp_path), device="cpu")


def test_text_prompt_without_tokenizer_is_refused_but_token_ids_work(tmp_path):
    path = testing.build_tiny_checkpoint(testing.tiny_llama_config(), tmp_path)
    llm = LLM(str(path), device="cpu")
    with pytest.raises(ValueError, match="no tokenizer files; pass prompt_token_ids"):
        llm.generate("hello")
    out = llm.generate(GOOD, testing.greedy(3))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.text == ""


def test_images_for_a_model_without_an_image_plugin_are_refused(llm, expected_good):
    from PIL import Image

    with pytest.raises(ValueError, match="no active plugin takes multi_modal_data"):
        llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": Image.new("RGB", (8, 8))}})
    _still_serves(llm, expected_good)
