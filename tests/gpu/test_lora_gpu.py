"""LoRA on CUDA: the Triton kernels inside CUDA graphs (decode and prefill steps) against
transformers + PEFT on the GPU, in float32 so that the comparison is exact up to the order of sums.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu/test_lora_gpu.py``. Skipped without CUDA.
"""

import pytest
import torch

from hookllm import LLM, SamplingParams, testing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("peft")

from lora_fixtures import build_adapters, lora_requests, peft_reference  # noqa: E402

MAX_TOKENS = 8
PROMPTS = testing.random_prompts(12, 320, min_len=20, max_len=200, seed=5)


@pytest.fixture(scope="module")
def requests(small_llama, tmp_path_factory):
    return lora_requests(build_adapters(small_llama, tmp_path_factory.mktemp("gpu-adapters")))


@torch.no_grad()
def reference_tokens(small_llama, request, prompt_indices):
    model = peft_reference(small_llama, None if request is None else request.lora_path).cuda()
    result = {}
    for i in prompt_indices:
        tokens = list(PROMPTS[i])
        for _ in range(MAX_TOKENS):
            tokens.append(int(model(input_ids=torch.tensor([tokens], device="cuda")).logits[0, -1].argmax()))
        result[i] = tokens[len(PROMPTS[i]):]
    return result


@pytest.fixture(scope="module")
def llm(small_llama):
    # Two slots for three adapters: slots are refilled between steps.
    engine = LLM(str(small_llama), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                 gpu_memory_utilization=0.3)
    assert engine.engine.engine_core.executor.runner.cuda_graphs is not None
    return engine


def generate(llm, lora_per_prompt):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([PROMPTS[i] for i in range(len(PROMPTS))], params, use_tqdm=False,
                           lora_request=lora_per_prompt)
    return [output.outputs[0].token_ids for output in outputs]


def test_a_mixed_batch_through_cuda_graphs_equals_peft(small_llama, requests, llm):
    names = [None, *requests]
    chosen = [names[i % len(names)] for i in range(len(PROMPTS))]
    got = generate(llm, [None if name is None else requests[name] for name in chosen])
    for name in names:
        indices = [i for i, n in enumerate(chosen) if n == name]
        expected = reference_tokens(small_llama, None if name is None else requests[name], indices)
        assert [got[i] for i in indices] == [expected[i] for i in indices], name


def test_steps_without_adapters_after_steps_with_them_are_the_base_model(small_llama, requests, llm):
    generate(llm, [requests["all"]] * len(PROMPTS))  # leaves the slots and the step mapping filled
    got = generate(llm, None)
    expected = reference_tokens(small_llama, None, range(len(PROMPTS)))
    assert got == [expected[i] for i in range(len(PROMPTS))]
