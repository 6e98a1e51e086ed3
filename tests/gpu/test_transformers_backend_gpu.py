"""The transformers modeling backend on CUDA: compiled (torch.compile) inside CUDA graphs.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu``. Skipped without CUDA. fp32 throughout,
so that differences come from the engine and not from bf16 rounding.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from hookllm import LLM, testing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 320


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Alternating sliding (window 64) and full layers, attention and final soft-capping."""
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                          sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
                          attn_logit_softcapping=20.0, final_logit_softcapping=10.0, max_position_embeddings=1024,
                          initializer_range=0.05, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return testing.build_tiny_checkpoint(config, tmp_path_factory.mktemp("gpu-gemma2"))


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), model_impl="transformers", dtype="float32", gpu_memory_utilization=0.3,
               max_num_batched_tokens=512, **kwargs)


def test_compiled_decoder_in_cuda_graphs_gives_the_eager_tokens(gemma2):
    prompts = testing.random_prompts(24, VOCAB, min_len=5, max_len=300, seed=21)
    requests = [{"prompt_token_ids": p} for p in prompts]
    compiled = engine(gemma2)
    model = compiled.engine.engine_core.executor.model
    assert compiled.engine.engine_core.executor.runner.cuda_graphs is not None
    assert model._decoder_hidden_states != model._run_decoder  # compiled
    eager = engine(gemma2, enforce_eager=True)
    assert eager.engine.engine_core.executor.runner.cuda_graphs is None
    ours = [o.outputs[0].token_ids for o in compiled.generate(requests, testing.greedy(24))]
    theirs = [o.outputs[0].token_ids for o in eager.generate(requests, testing.greedy(24))]
    assert ours == theirs


def test_llama_decoder_compiles_whole_on_cuda(tmp_path):
    """On CUDA hookllm's norm is a Triton kernel, but while dynamo traces it gives the torch
    reference: the decoder is one graph, with no break around the norms or attention."""
    from torch._dynamo.utils import counters

    config = testing.tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    path = testing.build_tiny_checkpoint(config, tmp_path)
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(str(path), model_impl="transformers", gpu_memory_utilization=0.3, max_num_batched_tokens=512)
    prompts = [{"prompt_token_ids": p} for p in testing.random_prompts(8, VOCAB, min_len=5, max_len=200, seed=23)]
    llm.generate(prompts, testing.greedy(8))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_sliding_window_and_soft_capping_on_cuda_equal_transformers(gemma2):
    """Prompt logits past the window, against transformers' eager attention in fp32 on the CPU
    (logits, not greedy tokens: the final soft-cap squeezes a random model's top logits into
    near-ties). Triton's fp32 dots run on TF32 tensor cores, hence a relative tolerance."""
    reference = AutoModelForCausalLM.from_pretrained(str(gemma2), dtype=torch.float32, attn_implementation="eager")
    llm = engine(gemma2)
    for prompt in testing.random_prompts(4, VOCAB, min_len=100, max_len=250, seed=22):
        with torch.inference_mode():
            expected = reference(torch.tensor([prompt])).logits[0]
        error = ((testing.prompt_logits(llm, prompt) - expected).norm() / expected.norm()).item()
        assert error < 5e-3, f"relative error {error:.3g}"
