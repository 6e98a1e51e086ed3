import gc

import pytest
import torch

from hookllm import testing


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each test's engines take a share of the GPU; free them before the next test sizes its cache."""
    yield
    # Drop compiled code (the transformers backend's decoder) along with the engines it served.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory):
    """A random Llama large enough for realistic kernel tiles: hidden 256, 4 layers, GQA 4:1,
    contexts up to 2048."""
    config = testing.tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    return testing.build_tiny_checkpoint(config, tmp_path_factory.mktemp("gpu-llama"))
