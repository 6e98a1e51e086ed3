import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each test's engines take a share of the GPU; free them before the next test sizes its cache."""
    yield
    # Drop compiled code (the transformers backend's decoder) along with the engines it served.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
