"""The engine on CUDA (bf16, Triton attention, CUDA graphs) against transformers in bf16.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

import random

import pytest
import torch

from hookllm import LLM, SamplingParams, testing
from hookllm.kernels import triton_variant_keys

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



def _bf16_reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()


def test_defaults_on_cuda_are_bf16_triton_and_a_memory_sized_cache(small_llama):
    llm = LLM(str(small_llama))
    worker = llm.engine.engine_core.executor
    assert worker.device.type == "cuda" and worker.dtype == torch.bfloat16
    assert worker.attention_backend.__name__.endswith("triton_attention")
    free, total = torch.cuda.mem_get_info()
    assert llm.engine.engine_core.scheduler.block_manager.num_blocks > 1000  # sized from memory, not a default
    assert free / total < 0.2  # the cache took its share (gpu_memory_utilization=0.9)


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16_and_first_tokens_match(small_llama):
    # bf16 rounding alone moves a random model's logits by several percent, so hookllm's bf16
    # error against the fp32 reference is held to transformers' own bf16 error on the same weights.
    fp32 = testing.load_reference(small_llama).cuda()
    bf16 = _bf16_reference(small_llama)
    llm = LLM(str(small_llama), gpu_memory_utilization=0.3)
    for prompt in testing.random_prompts(6, 320, min_len=20, max_len=300, seed=11):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            exact = fp32(ids).logits[0].float()
            theirs = bf16(ids).logits[0].float()
        ours = testing.prompt_logits(llm, prompt).cuda()
        ours_error = ((ours - exact).norm() / exact.norm()).item()
        theirs_error = ((theirs - exact).norm() / exact.norm()).item()
        assert ours_error < 1.5 * theirs_error + 1e-3, f"hookllm bf16 error {ours_error:.3g} vs transformers {theirs_error:.3g}"
        top2 = exact[-1].topk(2).values
        if (top2[0] - top2[1]).item() > 0.5:  # a clear winner: both bf16 engines must pick it
            assert ours[-1].argmax().item() == theirs[-1].argmax().item() == exact[-1].argmax().item()


def test_cuda_graphs_and_eager_give_identical_greedy_tokens(small_llama):
    prompts = [{"prompt_token_ids": p} for p in testing.random_prompts(40, 320, min_len=5, max_len=200, seed=12)]
    # fp32: in bf16 a padded graph batch picks other GEMM tiles than the eager one and flips near-ties.
    graphs = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=512, dtype="float32")
    assert graphs.engine.engine_core.executor.runner.cuda_graphs is not None
    eager = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=512, enforce_eager=True,
                dtype="float32")
    assert eager.engine.engine_core.executor.runner.cuda_graphs is None
    ours = [o.outputs[0].token_ids for o in graphs.generate(prompts, testing.greedy(24))]
    theirs = [o.outputs[0].token_ids for o in eager.generate(prompts, testing.greedy(24))]
    assert ours == theirs


def test_steps_with_prefill_as_cuda_graphs_give_the_eager_tokens(small_llama):
    prompts = [{"prompt_token_ids": p} for p in testing.random_prompts(40, 320, min_len=5, max_len=200, seed=15)]
    graphs = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=512, max_cuda_graph_tokens=512,
                 dtype="float32")
    runner = graphs.engine.engine_core.executor.runner.cuda_graphs
    assert runner.mixed_buckets[-1] == 512
    replayed = []  # each graph step's longest query: above 1 for a step with prefill
    run = runner.run
    runner.run = lambda *args: replayed.append(args[-1]) or run(*args)
    eager = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=512, enforce_eager=True,
                dtype="float32")
    ours = [o.outputs[0].token_ids for o in graphs.generate(prompts, testing.greedy(24))]
    theirs = [o.outputs[0].token_ids for o in eager.generate(prompts, testing.greedy(24))]
    assert ours == theirs
    assert any(longest > 1 for longest in replayed) and any(longest == 1 for longest in replayed)


def test_async_and_sync_scheduling_give_identical_tokens_on_cuda(small_llama):
    prompts = [{"prompt_token_ids": p} for p in testing.random_prompts(40, 320, min_len=5, max_len=200, seed=14)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in range(8, 48)]
    runs = []
    for async_scheduling in (True, False):
        llm = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=256, dtype="float32",
                  async_scheduling=async_scheduling)
        assert llm.engine.engine_core.max_in_flight == int(async_scheduling)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
        testing.assert_all_blocks_free(llm)
    assert runs[0] == runs[1]


def test_batched_equals_alone_on_cuda(small_llama):
    llm = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=128, num_kv_blocks=40,
              dtype="float32")
    testing.assert_batch_invariant(llm, testing.random_prompts(24, 320, min_len=5, max_len=120, seed=13), 16)


def test_seeded_sampling_on_cuda_equals_cpu(small_llama):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    gpu = LLM(str(small_llama), gpu_memory_utilization=0.3, dtype="float32").generate(prompt, params)
    cpu = LLM(str(small_llama), device="cpu", dtype="float32").generate(prompt, params)
    assert gpu[0].outputs[0].token_ids == cpu[0].outputs[0].token_ids


def test_seeded_sampling_of_a_batch_on_cuda_equals_cpu(small_llama):
    # Every row samples at its own temperature (the kernel once read the sampler's other parameters).
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=seed, ignore_eos=True) for seed in range(6)]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 9]} for i in range(6)]
    gpu = LLM(str(small_llama), gpu_memory_utilization=0.3, dtype="float32").generate(prompts, params)
    cpu = LLM(str(small_llama), device="cpu", dtype="float32").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]


def varied_requests(num: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of 1 to 1,500 tokens, half continuing one of three shared prefixes (a second run
    hits the prefix cache, leaving queries of every length), with every sampler path."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(320) for _ in range(length)] for length in (37, 300, 900)]
    prompts, params = [], []
    paths = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_k=40, top_p=0.9),
             dict(temperature=0.8, top_p=0.95), dict(temperature=0.8, min_p=0.05),
             dict(temperature=1.0, seed=7), dict(temperature=0.0, logprobs=3),
             dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
             dict(temperature=0.0, prompt_logprobs=2), dict(temperature=0.8, n=2)]
    for i in range(num):
        suffix = [rng.randrange(320) for _ in range(int(2 ** rng.uniform(0, 9)))]
        prompts.append({"prompt_token_ids": (rng.choice(prefixes) if i % 2 else []) + suffix})
        params.append(SamplingParams(max_tokens=rng.randint(1, 64), ignore_eos=True, **paths[i % len(paths)]))
    return prompts, params


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_after_the_warmup_a_varied_workload_compiles_no_triton_kernel(small_llama, enforce_eager):
    llm = LLM(str(small_llama), gpu_memory_utilization=0.3, enforce_eager=enforce_eager)
    assert llm.engine.engine_core.executor.warmup_seconds is not None
    compiled = triton_variant_keys()
    prompts, params = varied_requests(64, seed=21)
    for _ in range(2):  # the second run hits the prefix cache
        llm.generate(prompts, params, use_tqdm=False)
    assert triton_variant_keys() - compiled == set()


def test_warmup_leaves_generation_as_without_it_on_cuda(small_llama):
    prompts, params = varied_requests(24, seed=22)
    runs = []
    for warmup in (True, False):
        llm = LLM(str(small_llama), gpu_memory_utilization=0.3, dtype="float32", warmup=warmup)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([[(c.token_ids, c.logprobs) for c in o.outputs] for o in outputs])
        testing.assert_all_blocks_free(llm)
    assert runs[0] == runs[1]
