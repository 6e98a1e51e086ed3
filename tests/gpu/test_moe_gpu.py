"""Mixture of experts on CUDA: the fused MoE Triton kernels at bf16 and at realistic sizes against
the torch reference in float32, and the native MoE adapters in CUDA graphs against transformers.

Run on a machine with a GPU: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from hookllm import LLM, testing
from hookllm.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from hookllm.kernels import triton_moe

BF16 = torch.bfloat16
VOCAB = 320


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("tokens", [1, 256, 8192])
@pytest.mark.parametrize("experts, top_k, softmax_first, renormalize", [
    (128, 8, True, True),  # Qwen3-30B-A3B
    (32, 4, False, False),  # gpt-oss-20b
    (8, 2, True, False),  # Mixtral
])
def test_routing_and_alignment_kernels_equal_the_reference(tokens, experts, top_k, softmax_first, renormalize, dtype):
    logits = torch.randn(tokens, experts, device="cuda", generator=torch.Generator("cuda").manual_seed(tokens),
                         dtype=dtype)
    weights, ids = triton_moe.route(logits, top_k, renormalize=renormalize, softmax_first=softmax_first)
    want_weights, want_ids = reference.route(logits, top_k, renormalize=renormalize, softmax_first=softmax_first)
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    else:  # bf16 logits tie often: either of two equal experts is a right pick, in either order
        assert torch.equal(logits.gather(1, ids.long()), logits.gather(1, want_ids.long()))
    torch.testing.assert_close(weights, want_weights)
    for block_m in (16, 64, 128):
        got, want = triton_moe.moe_align(ids, experts, block_m), reference.moe_align(ids, experts, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("experts, top_k, hidden, inter, activation", [
    (128, 8, 2048, 768, "silu"),  # Qwen3-30B-A3B
    (32, 4, 2880, 2880, "swiglu_oai"),  # gpt-oss-20b
    (8, 2, 1024, 3584, "silu"),  # Mixtral's routing, narrower
])
def test_fused_moe_bf16_matches_the_fp32_reference(tokens, experts, top_k, hidden, inter, activation):
    generator = torch.Generator("cuda").manual_seed(tokens)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=generator)).to(BF16)

    x = randn(tokens, hidden)
    w_gate_up, w_down = randn(experts, 2 * inter, hidden, scale=hidden**-0.5), randn(experts, hidden, inter,
                                                                                      scale=inter**-0.5)
    oai = activation == "swiglu_oai"
    biases = dict(gate_up_bias=randn(experts, 2 * inter, scale=0.1), down_bias=randn(experts, hidden, scale=0.1),
                  swiglu_limit=7.0) if oai else {}
    logits = randn(tokens, experts)
    # Half the experts get no token at all in the small batches: the kernel must skip them.
    logits[:, experts // 2:] -= 100.0 if tokens < 64 else 0.0
    weights, ids = reference.route(logits, top_k, renormalize=not oai, softmax_first=not oai)
    out = triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids, activation=activation, **biases)
    f32 = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in biases.items()}
    ref = reference.fused_moe(x.float(), w_gate_up.float(), w_down.float(), weights, ids, activation=activation,
                              **f32)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("group", [None, 128], ids=["per-row", "block"])
def test_fp8_experts_match_the_fp32_reference_on_the_same_e4m3_weights(tokens, group):
    """Qwen3-30B-A3B's shape, experts e4m3 with per-row or 128-column block scales, weight-only."""
    generator = torch.Generator("cuda").manual_seed(tokens)
    experts, top_k, hidden, inter = 128, 8, 2048, 768

    def fp8(*shape):
        weight = torch.randn(*shape, device="cuda", generator=generator) * shape[-1] ** -0.5
        q, scale = reference.quantize_fp8(weight.flatten(0, 1), group or shape[-1])
        return q.view(shape), scale.view(*shape[:2], -1)

    (w_gate_up, gate_up_scale), (w_down, down_scale) = fp8(experts, 2 * inter, hidden), fp8(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).to(BF16)
    weights, ids = reference.route(torch.randn(tokens, experts, device="cuda", generator=generator), top_k,
                                   renormalize=True, softmax_first=True)
    scales = dict(gate_up_scale=gate_up_scale, down_scale=down_scale)
    out = triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids, **scales)
    ref = reference.fused_moe(x.float(), w_gate_up, w_down, weights, ids, **scales)
    assert rel_error(out, ref) < 1e-2


def test_absent_experts_add_nothing_and_halves_sum_to_the_whole():
    """Expert parallelism: two ranks' shares (each with the other's experts absent) sum to all experts."""
    generator = torch.Generator("cuda").manual_seed(0)
    experts, top_k, hidden, inter, tokens = 16, 4, 512, 256, 200
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).to(BF16)
    w13 = (0.05 * torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator)).to(BF16)
    w2 = (0.05 * torch.randn(experts, hidden, inter, device="cuda", generator=generator)).to(BF16)
    weights, ids = reference.route(torch.randn(tokens, experts, device="cuda", generator=generator), top_k,
                                   renormalize=True, softmax_first=True)
    whole = triton_moe.fused_moe(x, w13, w2, weights, ids).float()
    half = experts // 2
    shares = []
    for first in (0, half):
        local = ids - first
        local = torch.where((local >= 0) & (local < half), local, torch.full_like(local, half))
        shares.append(triton_moe.fused_moe(x, w13[first:first + half], w2[first:first + half], weights, local,
                                           experts_elsewhere=True).float())
    assert rel_error(shares[0] + shares[1], whole) < 1e-2


CONFIGS = {
    "qwen3-moe": lambda: Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                        moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                                        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                        head_dim=32, norm_topk_prob=True, max_position_embeddings=1024,
                                        initializer_range=0.1),
    "qwen2-moe-shared": lambda: Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                               moe_intermediate_size=128, shared_expert_intermediate_size=256,
                                               num_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
                                               num_attention_heads=8, num_key_value_heads=2,
                                               max_position_embeddings=1024, initializer_range=0.1),
    "mixtral": lambda: MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_local_experts=8,
                                     num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=8,
                                     num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1),
    "gpt-oss": lambda: GptOssConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_local_experts=8,
                                    num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=32, sliding_window=64,
                                    layer_types=["sliding_attention", "full_attention"] * 2,
                                    max_position_embeddings=1024, initializer_range=0.1),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_native_moe_adapter_in_cuda_graphs_gives_transformers_greedy_tokens(name, tmp_path):
    """fp32, so that a difference comes from the engine, not from bf16 rounding; prompts past
    gpt-oss's window, CUDA graphs for decode and mixed steps."""
    path = testing.build_tiny_checkpoint(CONFIGS[name](), tmp_path / name)
    reference_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    prompts = testing.random_prompts(6, VOCAB, min_len=20, max_len=200, seed=3)
    expected = [testing.reference_greedy(reference_model, p, 16) for p in prompts]
    assert sum(len(set(t)) > 1 for t in expected) >= 3, "constant reference outputs prove little"
    llm = LLM(str(path), dtype="float32", gpu_memory_utilization=0.3, max_num_batched_tokens=256)
    model = llm.engine.engine_core.executor.model
    assert type(model).__module__.startswith(("hookllm.adapters.moe", "hookllm.adapters.gpt_oss"))
    assert llm.engine.engine_core.executor.runner.cuda_graphs is not None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], testing.greedy(16), use_tqdm=False)
    # TF32 dots in the attention kernels may flip a near-tie late in a sequence: most must match whole.
    matches = sum(o.outputs[0].token_ids == e for o, e in zip(outputs, expected))
    assert matches >= 5, f"{matches} of 6 greedy continuations equal transformers'"
