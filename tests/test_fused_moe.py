"""The mixture-of-experts kernels: routing, the expert-sorted padding of (token, slot) pairs,
the torch reference of the fused MoE against transformers' own MoE blocks, and the Triton
grouped GEMMs (run by the Triton interpreter, which tests/conftest.py selects on machines
without CUDA) against the reference. Shapes are tiny: the interpreter runs each program in numpy."""

import math

import pytest
import torch
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hookllm.kernels import reference

TOKENS, EXPERTS, HIDDEN, INTER, TOP_K = 12, 4, 32, 16, 2

# Row 0's probabilities are (1, 2, 4, 1) / 8, row 1's (5, 1, 3, 1) / 10.
LOGITS = torch.tensor([[0.0, math.log(2), math.log(4), 0.0], [math.log(5), 0.0, math.log(3), 0.0]])


@pytest.mark.parametrize("renormalize, expected", [
    (False, [[4 / 8, 2 / 8], [5 / 10, 3 / 10]]),
    (True, [[2 / 3, 1 / 3], [5 / 8, 3 / 8]]),
])
def test_route_softmax_then_top_k(renormalize, expected):
    weights, ids = reference.route(LOGITS, 2, renormalize=renormalize, softmax_first=True)
    assert ids.dtype == torch.int32 and ids.tolist() == [[2, 1], [0, 2]]
    torch.testing.assert_close(weights, torch.tensor(expected))


def test_route_top_k_then_softmax_weights_sum_to_one():
    weights, ids = reference.route(LOGITS, 2, renormalize=False, softmax_first=False)
    assert ids.tolist() == [[2, 1], [0, 2]]
    torch.testing.assert_close(weights, torch.tensor([[4 / 6, 2 / 6], [5 / 8, 3 / 8]]))


def check_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Every pair once, in its expert's run; runs padded with the sentinel to whole blocks."""
    sorted_ids, expert_of_block, num_padded = reference.moe_align(topk_ids, num_experts, block_m)
    pairs = topk_ids.numel()
    flat = topk_ids.flatten()
    used = int(num_padded)
    assert used % block_m == 0
    assert len(expert_of_block) * block_m >= len(sorted_ids) >= used
    assert (sorted_ids[used:] == pairs).all()
    real = sorted_ids[:used][sorted_ids[:used] < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    counts = torch.bincount(flat.long(), minlength=num_experts)
    expected_blocks = [e for e in range(num_experts) for _ in range(-(-int(counts[e]) // block_m))]
    assert expert_of_block[: used // block_m].tolist() == expected_blocks
    assert (expert_of_block[used // block_m:] == num_experts).all()
    for block, expert in enumerate(expected_blocks):
        rows = sorted_ids[block * block_m:(block + 1) * block_m]
        assert (flat[rows[rows < pairs].long()] == expert).all()


def test_moe_align_pads_each_expert_and_skips_empty_ones():
    # Expert 1 gets nothing; experts 0 and 2 get four pairs from four tokens each; expert 3 two.
    topk_ids = torch.tensor([[0, 2], [2, 0], [3, 0], [0, 2], [2, 3]], dtype=torch.int32)
    sorted_ids, expert_of_block, num_padded = reference.moe_align(topk_ids, 4, block_m=4)
    assert num_padded.tolist() == [12]
    assert sorted_ids[:12].tolist() == [0, 3, 5, 6, 1, 2, 7, 8, 4, 9, 10, 10]
    assert expert_of_block.tolist() == [0, 2, 3, 4, 4, 4]
    check_alignment(topk_ids, 4, block_m=4)


@pytest.mark.parametrize("block_m", [1, 3, 16])
def test_moe_align_random_routing(block_m):
    topk_ids = torch.stack([torch.randperm(6)[:3] for _ in range(7)]).int()
    check_alignment(topk_ids, 6, block_m)


def random_moe_block(norm_topk_prob: bool) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return block


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@torch.no_grad()
def test_reference_matches_transformers_qwen3_moe_block(norm_topk_prob):
    block = random_moe_block(norm_topk_prob)
    hidden = torch.randn(TOKENS, HIDDEN)
    weights, ids = reference.route(block.gate(hidden)[0], TOP_K, renormalize=norm_topk_prob, softmax_first=True)
    out = reference.fused_moe(hidden, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    torch.testing.assert_close(out, block(hidden[None])[0], atol=1e-5, rtol=1e-5)


def random_gpt_oss_experts() -> GptOssExperts:
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, swiglu_limit=1.0)
    experts = GptOssExperts(config)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.5)
    return experts


def oss_weights(experts: GptOssExperts) -> dict:
    """gpt-oss's experts in fused_moe's layout: its gate/up columns interleave, its matrices are
    [in, out]."""
    gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias
    return dict(w_gate_up=torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2),
                w_down=experts.down_proj.transpose(1, 2),
                gate_up_bias=torch.cat([bias[..., ::2], bias[..., 1::2]], dim=-1),
                down_bias=experts.down_proj_bias, activation="swiglu_oai", swiglu_limit=experts.limit)


@torch.no_grad()
def test_reference_matches_transformers_gpt_oss_experts():
    experts = random_gpt_oss_experts()
    hidden = torch.randn(TOKENS, HIDDEN)
    weights, ids = reference.route(torch.randn(TOKENS, EXPERTS), TOP_K, renormalize=False, softmax_first=False)
    out = reference.fused_moe(hidden, topk_weights=weights, topk_ids=ids, **oss_weights(experts))
    torch.testing.assert_close(out, experts(hidden, ids.long(), weights), atol=1e-5, rtol=1e-5)


def routing_without_expert(missing: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing of TOKENS tokens that never picks expert ``missing``."""
    logits = torch.randn(TOKENS, EXPERTS)
    logits[:, missing] = float("-inf")
    return reference.route(logits, TOP_K, renormalize=True, softmax_first=True)


@pytest.fixture
def triton_moe(poisoned_empty):
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the interpreter is for CPU-only machines")
    from hookllm.kernels import triton_moe

    return triton_moe


@pytest.mark.parametrize("block_m", [16, 32])
@torch.no_grad()
def test_triton_fused_moe_matches_reference(triton_moe, block_m):
    block = random_moe_block(norm_topk_prob=True)
    hidden = torch.randn(TOKENS, HIDDEN)
    weights, ids = routing_without_expert(missing=1)
    args = (hidden, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    config = triton_moe.MoeConfig(block_m=block_m, block_n=16, block_k=16, num_warps=4, num_stages=1)
    out = triton_moe.fused_moe_with(*args, activation="silu", gate_up_bias=None, down_bias=None,
                                    swiglu_limit=None, config=config)
    torch.testing.assert_close(out, reference.fused_moe(*args), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_triton_fused_moe_default_config_and_gpt_oss_activation(triton_moe):
    experts = random_gpt_oss_experts()
    hidden = torch.randn(TOKENS, HIDDEN)
    weights, ids = routing_without_expert(missing=3)
    weights_and_layout = oss_weights(experts)  # strided views, as an adapter may pass them
    out = triton_moe.fused_moe(hidden, topk_weights=weights, topk_ids=ids, **weights_and_layout)
    expected = reference.fused_moe(hidden, topk_weights=weights, topk_ids=ids, **weights_and_layout)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softmax_first, renormalize", [(True, False), (True, True), (False, False)])
def test_triton_route_equals_reference(triton_moe, softmax_first, renormalize):
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(3))
    weights, ids = triton_moe.route(logits, 3, renormalize=renormalize, softmax_first=softmax_first)
    want_weights, want_ids = reference.route(logits, 3, renormalize=renormalize, softmax_first=softmax_first)
    assert ids.dtype == torch.int32 and ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("block_m", [1, 3, 16])
def test_triton_moe_align_equals_reference_over_several_chunks(triton_moe, block_m):
    # 150 pairs: three programs' chunks, whose pairs of one expert must keep their order; id 6 is
    # an absent expert (held by another expert-parallel rank).
    topk_ids = torch.stack([torch.randperm(7, generator=torch.Generator().manual_seed(i))[:2] for i in range(75)]).int()
    got = triton_moe.moe_align(topk_ids, 6, block_m)
    want = reference.moe_align(topk_ids, 6, block_m)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]


def test_moe_align_gives_absent_pairs_no_row():
    """Id ``num_experts`` marks a pair whose expert another expert-parallel rank holds."""
    topk_ids = torch.tensor([[0, 2], [2, 0], [1, 2]], dtype=torch.int32)  # 2 = absent of 2 experts
    sorted_ids, expert_of_block, num_padded = reference.moe_align(topk_ids, 2, block_m=2)
    assert num_padded.tolist() == [4]
    assert sorted_ids[:4].tolist() == [0, 3, 4, 6]  # expert 0: pairs 0 and 3; expert 1: pair 4, then padding
    assert (sorted_ids[4:] == 6).all() and expert_of_block[:2].tolist() == [0, 1]


@torch.no_grad()
def test_two_expert_parallel_shares_sum_to_the_whole_layer(triton_moe):
    """Each half of the experts, the other half absent, in the Triton kernels (which then zero the
    rows of absent pairs) and the reference; their sum is the whole layer."""
    block = random_moe_block(norm_topk_prob=True)
    hidden = torch.randn(TOKENS, HIDDEN)
    weights, ids = reference.route(block.gate(hidden)[0], TOP_K, renormalize=True, softmax_first=True)
    whole = reference.fused_moe(hidden, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    half = EXPERTS // 2
    for kernels in (reference, triton_moe):
        shares = []
        for first in (0, half):
            local = torch.where((ids >= first) & (ids < first + half), ids - first, torch.full_like(ids, half))
            experts = slice(first, first + half)
            shares.append(kernels.fused_moe(hidden, block.experts.gate_up_proj[experts],
                                            block.experts.down_proj[experts], weights, local, experts_elsewhere=True))
        torch.testing.assert_close(shares[0] + shares[1], whole, atol=1e-5, rtol=1e-5)


def test_fused_moe_layer_loads_per_expert_and_stacked_tensors_alike():
    """The hub's per-expert tensors (``experts.3.gate_proj.weight``) and transformers 5's stacked
    ones fill the layer identically, and it computes transformers' block."""
    from hookllm.layers.fused_moe import FusedMoE, expert_tensor_renamer

    block = random_moe_block(norm_topk_prob=True)
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    stacked = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True)
    assert stacked.weight_loader(stacked.gate_up_proj, gate_up) == stacked.expected_shards("gate_up_proj")
    stacked.weight_loader(stacked.down_proj, down)
    per_expert = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True)
    rename = expert_tensor_renamer({"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
    for e in range(EXPERTS):
        for proj, tensor in (("gate_proj", gate_up[e, :INTER]), ("up_proj", gate_up[e, INTER:]),
                             ("down_proj", down[e])):
            name, shard = rename(f"model.layers.0.mlp.experts.{e}.{proj}.weight")
            param = per_expert.gate_up_proj if name.endswith("gate_up_proj") else per_expert.down_proj
            assert per_expert.weight_loader(param, tensor, shard) == [shard]
    assert torch.equal(per_expert.gate_up_proj, stacked.gate_up_proj) and torch.equal(per_expert.down_proj, down)
    hidden = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(per_expert(hidden, block.gate(hidden)[0]), block(hidden[None])[0],
                                   atol=1e-5, rtol=1e-5)


def test_fused_moe_layer_refuses_a_wrong_shaped_expert_tensor():
    from hookllm.layers.fused_moe import FusedMoE

    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER)
    with pytest.raises(ValueError, match=r"expert gate projection: checkpoint shape \(16, 31\) != expected \(16, 32\)"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(INTER, HIDDEN - 1), "gate:0")
    with pytest.raises(ValueError, match=r"unknown expert shard 'gate:9'"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(INTER, HIDDEN), "gate:9")


def test_default_config_keeps_a_stage_of_fp32_tiles_in_bf16s_shared_memory():
    """The tuned (bf16) tiles would overflow the H200's shared memory in fp32: the reduction step halves."""
    from hookllm.kernels import triton_moe as kernels

    bf16 = kernels.default_config(256, 8, 128)  # 16 pairs per expert
    fp32 = kernels.default_config(256, 8, 128, element_size=4)
    assert (fp32.block_m, fp32.block_n, fp32.block_k) == (bf16.block_m, bf16.block_n, bf16.block_k // 2)


def fp8_experts(weight: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[experts, rows, cols]`` weights as e4m3 with scales per row (``group`` None) or per row
    and ``group`` columns, worked out here from each group's absolute maximum."""
    experts, rows, cols = weight.shape
    group = group or cols
    amax = weight.abs().view(experts, rows, cols // group, group).amax(dim=3)
    scale = amax / reference.FP8_MAX
    q = (weight / scale.repeat_interleave(group, dim=2)).to(reference.FP8_DTYPE)
    return q, scale


def fp8_moe_case(group: int | None) -> tuple[tuple, dict[str, torch.Tensor], list[torch.Tensor]]:
    """A random layer's inputs with e4m3 experts: (hidden, weights, routing), their scales, and
    the dequantized weights."""
    block = random_moe_block(norm_topk_prob=True)
    hidden = torch.randn(TOKENS, HIDDEN)
    weights, ids = routing_without_expert(missing=1)
    (gate_up, gate_up_scale), (down, down_scale) = (fp8_experts(w.detach(), group)
                                                    for w in (block.experts.gate_up_proj, block.experts.down_proj))
    dequantized = [q.float() * s.repeat_interleave(q.shape[2] // s.shape[2], dim=2)
                   for q, s in ((gate_up, gate_up_scale), (down, down_scale))]
    return (hidden, gate_up, down, weights, ids), dict(gate_up_scale=gate_up_scale, down_scale=down_scale), dequantized


@pytest.mark.parametrize("group", [None, 8])
@torch.no_grad()
def test_fp8_experts_compute_the_layer_of_their_dequantized_weights(group):
    """e4m3 experts with scales per row or per row and block of columns (the reference)."""
    (hidden, gate_up, down, weights, ids), scales, dequantized = fp8_moe_case(group)
    expected = reference.fused_moe(hidden, *dequantized, weights, ids)
    out = reference.fused_moe(hidden, gate_up, down, weights, ids, **scales)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [None, 8])
@torch.no_grad()
def test_triton_fp8_experts_match_reference(triton_moe, group):
    args, scales, _ = fp8_moe_case(group)
    config = triton_moe.MoeConfig(block_m=16, block_n=16, block_k=8, num_warps=4, num_stages=1)
    out = triton_moe.fused_moe_with(*args, activation="silu", gate_up_bias=None, down_bias=None, swiglu_limit=None,
                                    config=config, **scales)
    torch.testing.assert_close(out, reference.fused_moe(*args, **scales), atol=1e-5, rtol=1e-5)
