"""Tensor parallelism on two GPUs (NCCL, CUDA graphs captured with the all-reduces inside).

Run on a machine with two GPUs: ``pytest -m gpu tests/gpu/test_tensor_parallel_gpu.py``.
"""

import gc

import pytest
import torch

from hookllm import LLM, SamplingParams, testing

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

PROMPTS = testing.random_prompts(8, 320, min_len=20, max_len=200, seed=11)


def outputs(path, dtype: str, tp: int, enforce_eager: bool = False):
    llm = LLM(str(path), dtype=dtype, tensor_parallel_size=tp, gpu_memory_utilization=0.3,
              enforce_eager=enforce_eager)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_tp2_fp32_greedy_tokens_equal_tp1(small_llama, enforce_eager):
    one = outputs(small_llama, "float32", 1)
    two = outputs(small_llama, "float32", 2, enforce_eager)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_tp2_bf16_logprobs_are_within_bf16_rounding_of_tp1(small_llama):
    one, two = outputs(small_llama, "bfloat16", 1), outputs(small_llama, "bfloat16", 2)
    # The first token of each prompt comes from identical inputs: its logprob differs by rounding only.
    for a, b in zip(one, two):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        token = a.outputs[0].token_ids[0]
        if token in first_b:
            assert abs(first_a[token].logprob - first_b[token].logprob) < 0.05
