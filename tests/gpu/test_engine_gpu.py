"""The engine on CUDA (bf16, Triton attention, CUDA graphs) against transformers in bf16.

Run on the GPU machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

import pytest
import torch

from hookllm import LLM, SamplingParams, testing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]



def _bf16_reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    # Big enough that bf16 rounding stays far below the logit gaps: hidden 256, 4 layers, GQA 4:1.
    config = testing.tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    return testing.build_tiny_checkpoint(config, tmp_path_factory.mktemp("gpu-llama"))


def test_defaults_on_cuda_are_bf16_triton_and_a_memory_sized_cache(small_llama):
    llm = LLM(str(small_llama))
    worker = llm.engine.worker
    assert worker.device.type == "cuda" and worker.dtype == torch.bfloat16
    assert worker.attention_backend.__name__.endswith("triton_attention")
    free, total = torch.cuda.mem_get_info()
    assert llm.engine.block_manager.num_blocks > 1000  # sized from memory, not a default
    assert free / total < 0.2  # the cache took its share (gpu_memory_utilization=0.9)


def test_first_tokens_and_logits_match_transformers_bf16(small_llama):
    reference = _bf16_reference(small_llama)
    llm = LLM(str(small_llama), gpu_memory_utilization=0.3)
    prompts = testing.random_prompts(6, 320, min_len=20, max_len=300, seed=11)
    for prompt in prompts:
        ours = testing.prompt_logits(llm, prompt).cuda()
        with torch.inference_mode():
            theirs = reference(torch.tensor([prompt], device="cuda")).logits[0].float()
        rel = ((ours - theirs).norm() / theirs.norm()).item()
        assert rel < 2e-2, f"bf16 logits differ by {rel:.3g} relative"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], testing.greedy(4))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, -1].item()
        assert out.outputs[0].token_ids[0] == expected


def test_cuda_graphs_and_eager_give_identical_greedy_tokens(small_llama):
    prompts = [{"prompt_token_ids": p} for p in testing.random_prompts(40, 320, min_len=5, max_len=200, seed=12)]
    graphs = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=512)
    assert graphs.engine.worker.runner.cuda_graphs is not None
    eager = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=512, enforce_eager=True)
    assert eager.engine.worker.runner.cuda_graphs is None
    ours = [o.outputs[0].token_ids for o in graphs.generate(prompts, testing.greedy(24))]
    theirs = [o.outputs[0].token_ids for o in eager.generate(prompts, testing.greedy(24))]
    assert ours == theirs


def test_batched_equals_alone_on_cuda(small_llama):
    llm = LLM(str(small_llama), gpu_memory_utilization=0.3, max_num_batched_tokens=128, num_kv_blocks=40)
    testing.assert_batch_invariant(llm, testing.random_prompts(24, 320, min_len=5, max_len=120, seed=13), 16)


def test_seeded_sampling_on_cuda_equals_cpu(small_llama):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    gpu = LLM(str(small_llama), gpu_memory_utilization=0.3, dtype="float32").generate(prompt, params)
    cpu = LLM(str(small_llama), device="cpu", dtype="float32").generate(prompt, params)
    assert gpu[0].outputs[0].token_ids == cpu[0].outputs[0].token_ids
