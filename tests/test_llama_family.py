"""The Llama adapter reproduces transformers on tiny random models of each family (fp32, CPU)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from hookllm import LLM, testing

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)

FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON),
    "llama3-rope-scaling-tied": lambda: LlamaConfig(
        **COMMON, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = testing.build_tiny_checkpoint(FAMILIES[request.param](), tmp_path_factory.mktemp(request.param))
    llm = LLM(str(path), dtype="float32", device="cpu")
    return path, llm, testing.load_reference(path)


def test_prefill_logits_match_transformers(family):
    path, llm, reference = family
    for prompt in testing.random_prompts(3, 300, min_len=5, max_len=60, seed=3):
        testing.assert_prefill_logits_match(llm, reference, prompt)


def test_greedy_tokens_match_transformers_generate(family):
    path, llm, reference = family
    testing.assert_greedy_matches(llm, reference, testing.random_prompts(4, 300, seed=4), max_tokens=16)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    path = testing.build_tiny_checkpoint(FAMILIES["llama"](), tmp_path / "single")
    tensors = load_file(str(path / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((path / "config.json").read_text())
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        filename = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(sharded / filename))
        weight_map.update({n: filename for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [5, 17, 99, 3, 250]
    single = testing.prompt_logits(LLM(str(path), dtype="float32", device="cpu"), prompt)
    split = testing.prompt_logits(LLM(str(sharded), dtype="float32", device="cpu"), prompt)
    torch.testing.assert_close(split, single, rtol=0, atol=0)
