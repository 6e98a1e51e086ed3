import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each test's engines take a share of the GPU; free them before the next test sizes its cache."""
    yield
    # Compiled code (the transformers backend's decoder) holds its model until dynamo's caches go.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
