import os

import torch

# Nothing may be fetched from a model hub: every model in the tests is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton picks its interpreter when first imported: set it before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers import LlamaConfig

from hookllm import LLM, testing


def tiny_llama_config(**overrides) -> LlamaConfig:
    fields = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama with a trained byte-level BPE tokenizer, saved once per session."""
    path = tmp_path_factory.mktemp("tiny-llama")
    testing.build_tiny_checkpoint(tiny_llama_config(), path)
    testing.build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_reference(tiny_llama_dir):
    return testing.load_reference(tiny_llama_dir)


@pytest.fixture
def make_llm(tiny_llama_dir):
    """LLM over the tiny Llama on the CPU in fp32; keyword arguments go to LLM()."""
    def make(**kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        return LLM(str(tiny_llama_dir), **kwargs)
    return make


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
