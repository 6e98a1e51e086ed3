import os

import torch

# Nothing may be fetched from a model hub: every model in the tests is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton picks its interpreter when first imported: set it before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hookllm import LLM, testing


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama with a trained byte-level BPE tokenizer, saved once per session."""
    path = tmp_path_factory.mktemp("tiny-llama")
    testing.build_tiny_checkpoint(testing.tiny_llama_config(), path)
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


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled floats, so an output element nothing wrote cannot pass."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
