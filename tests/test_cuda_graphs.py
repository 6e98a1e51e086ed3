"""CUDA graphs' buckets and option (the graphs themselves need CUDA: tests/gpu/test_engine_gpu.py)."""

import pytest

from hookllm.config import EngineConfig
from hookllm.worker.cuda_graph import batch_size_buckets, speculating_buckets, token_buckets


def test_decode_buckets_are_small_powers_of_two_then_every_16():
    assert batch_size_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_token_buckets_pad_at_most_half_and_end_at_the_limit():
    assert token_buckets(200) == [16, 24, 32, 48, 64, 96, 128, 192, 200]
    assert token_buckets(128) == [16, 24, 32, 48, 64, 96, 128]
    assert token_buckets(0) == []


def test_token_buckets_add_the_exact_sizes_of_verification_steps_below_the_limit():
    assert token_buckets(200, [5 * b for b in (1, 2, 4, 8, 16, 32, 48)]) == [
        5, 10, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 200]


def test_speculating_buckets_stop_at_the_one_holding_disable_by_batch_size():
    assert speculating_buckets(64, None) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert speculating_buckets(64, 20) == [1, 2, 4, 8, 16, 32]
    assert speculating_buckets(64, 16) == [1, 2, 4, 8, 16]
    assert speculating_buckets(64, 100) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_steps_with_prefill_of_up_to_8192_tokens_run_as_graphs_by_default():
    assert EngineConfig(model="m").max_cuda_graph_tokens == 8192
    with pytest.raises(ValueError, match="max_cuda_graph_tokens must be >= 0, got -1"):
        EngineConfig(model="m", max_cuda_graph_tokens=-1)
