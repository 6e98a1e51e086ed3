"""FP8 kernels: the torch references against values worked out by hand, and the Triton kernels
(interpreted, tiny shapes) against the references; then the FP8 KV cache in both attention
backends."""

from __future__ import annotations

import os

import pytest
import torch

from hookllm.kernels import reference

FP8 = torch.float8_e4m3fn
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_quantize_fp8_scales_each_group_by_its_absolute_maximum():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.25], [0.0, 0.0, 3.0, -6.0]])
    q, scale = reference.quantize_fp8(x, group_size=2)
    # Row 0: groups (1, -2) and (0.5, 0.25); row 1: an all-zero group, then (3, -6).
    want_scale = torch.tensor([[2 / 448, 0.5 / 448], [reference.FP8_MIN_SCALE, 6 / 448]])
    torch.testing.assert_close(scale, want_scale)
    assert q.dtype == FP8
    assert q.float().tolist() == [[224.0, -448.0, 448.0, 224.0], [0.0, 0.0, 224.0, -448.0]]


def test_quantize_fp8_per_token_is_one_group_per_row():
    x = torch.tensor([[1.0, -4.0, 2.0]])
    q, scale = reference.quantize_fp8(x, group_size=3)
    assert scale.shape == (1, 1) and scale.item() == pytest.approx(4 / 448)
    assert q.float().tolist() == [[112.0, -448.0, 224.0]]


def test_to_fp8_saturates_instead_of_overflowing():
    assert reference.to_fp8(torch.tensor([1000.0, -1000.0]), 1.0).float().tolist() == [448.0, -448.0]


def assert_same_e4m3_where_rounding_stays_in_its_binade(got: torch.Tensor, want: torch.Tensor,
                                                       unrounded: torch.Tensor) -> None:
    """The Triton interpreter's e4m3 cast is wrong when rounding carries into the next power of
    two (126.9 becomes 64, not 128) and truncates subnormals; the GPU's is exact (tests/gpu).
    Elsewhere they must agree."""
    binade = lambda t: torch.floor(torch.log2(t.float().abs().clamp(min=2 ** -9)))  # noqa: E731
    stays = (binade(unrounded) == binade(want)) & (want.float().abs() >= 2 ** -6)
    assert stays.float().mean() > 0.8, "too few values to compare"
    assert torch.equal(got.float()[stays], want.float()[stays])


def random_fp8(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 64).clamp(-448, 448).to(FP8)


def test_scaled_matmul_sums_each_groups_product_times_its_scales():
    """The definition, block by block: sum over column groups g of (a_g @ b_g^T) * sa_g * sb_g."""
    a, b = random_fp8(3, 8, seed=0), random_fp8(5, 8, seed=1)
    a_scale, b_scale = torch.rand(3, 2) + 0.5, torch.rand(5, 2) + 0.5
    want = sum((a.float()[:, g * 4:(g + 1) * 4] @ b.float()[:, g * 4:(g + 1) * 4].T)
               * a_scale[:, g:g + 1] * b_scale[:, g][None, :] for g in range(2))
    got = reference.scaled_matmul(a, a_scale, b, b_scale, torch.float32)
    torch.testing.assert_close(got, want)


def test_scaled_matmul_weight_only_scales_the_weight_alone():
    x, b = torch.randn(2, 6), random_fp8(3, 6, seed=2)
    b_scale = torch.rand(3, 1)
    bias = torch.randn(3)
    got = reference.scaled_matmul(x, None, b, b_scale, torch.float32, bias)
    torch.testing.assert_close(got, x @ (b.float() * b_scale).T + bias)


@interpreted
@pytest.mark.parametrize("group_size", [32, 64], ids=["per-group", "per-token"])
def test_triton_quantize_fp8_equals_reference(group_size):
    from hookllm.kernels import triton_fp8

    x = torch.randn(5, 64) * 3
    q, scale = triton_fp8.quantize_fp8(x, group_size)
    want_q, want_scale = reference.quantize_fp8(x, group_size)
    torch.testing.assert_close(scale, want_scale)
    assert_same_e4m3_where_rounding_stays_in_its_binade(q, want_q, x / reference.expand_groups(want_scale, 64))


@interpreted
@pytest.mark.parametrize("split_k", [1, 3], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("kind", ["per-channel", "block", "weight-only"])
def test_triton_scaled_matmul_equals_reference(kind, split_k):
    """Split-K: 3 splits of 2 K steps, one of them empty; the partial sums add up, bias once."""
    from hookllm.kernels import triton_fp8

    rows, cols, outputs = 20, 64, 48
    b = random_fp8(outputs, cols, seed=3)
    bias = torch.randn(outputs)
    groups = 2 if kind == "block" else 1
    b_scale = torch.rand(outputs, groups) / 64
    if kind == "weight-only":
        a, a_scale = torch.randn(rows, cols), None
    else:
        a, a_scale = random_fp8(rows, cols, seed=4), torch.rand(rows, groups) / 64
    config = triton_fp8.MatmulConfig(16, 32, 32, 4, 1, split_k=split_k)
    got = triton_fp8.scaled_matmul_with(a, a_scale, b, b_scale, torch.float32, bias, config)
    torch.testing.assert_close(got, reference.scaled_matmul(a, a_scale, b, b_scale, torch.float32, bias))


def test_default_config_splits_k_only_while_the_tiles_leave_the_sms_idle():
    """One row by 4096 outputs makes 128 tiles of 32 columns, 14336 columns 112 K steps of 128:
    doubling the split while the programs stay within 4 per SM of 132 (528) and each split keeps
    16 steps gives 4; 4096 columns (32 steps) stop at 2; 28672 outputs (896 tiles) fill the GPU."""
    from hookllm.kernels import triton_fp8

    assert triton_fp8.default_config(1, 4096, 14336, sm_count=132).split_k == 4
    assert triton_fp8.default_config(1, 4096, 4096, sm_count=132).split_k == 2
    assert triton_fp8.default_config(1, 4096, 2048, sm_count=132).split_k == 1
    assert triton_fp8.default_config(1, 28672, 4096, sm_count=132).split_k == 1
    assert triton_fp8.default_config(1, 4096, 14336).split_k == 1  # no GPU, no split


# -- the FP8 KV cache ----------------------------------------------------------------------------
BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 16


def filled_caches(backend, dtype, k_scale: float, v_scale: float, seed: int = 0):
    """Two sequences (20 and 7 tokens) stored into fresh caches, and the attention inputs."""
    generator = torch.Generator().manual_seed(seed)
    lens = [20, 7]
    tokens = sum(lens)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=generator) * 2
    v = torch.randn(tokens, KV_HEADS, DIM, generator=generator) * 2
    q = torch.randn(tokens, HEADS, DIM, generator=generator)
    k_cache = torch.zeros(4, BLOCK, KV_HEADS, DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    slots = torch.cat([torch.arange(20), 32 + torch.arange(7)])
    backend.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    metadata = dict(block_tables=block_tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
                    query_start_loc=torch.tensor([0, 20, 27], dtype=torch.int32), max_query_len=20, max_seq_len=20,
                    scale=DIM ** -0.5)
    return q, k, v, k_cache, v_cache, slots, metadata


def test_fp8_cache_stores_keys_and_values_divided_by_their_scales():
    _, k, v, k_cache, v_cache, slots, _ = filled_caches(reference, FP8, k_scale=0.5, v_scale=0.25)
    flat_k = k_cache.view(-1, KV_HEADS, DIM)[slots]
    flat_v = v_cache.view(-1, KV_HEADS, DIM)[slots]
    assert torch.equal(flat_k.float(), (k / 0.5).to(FP8).float())
    assert torch.equal(flat_v.float(), (v / 0.25).to(FP8).float())


def test_attention_over_an_fp8_cache_equals_attention_over_its_values():
    """The scales multiply back: the same as a float32 cache holding scale * stored value."""
    q, _, _, k_cache, v_cache, _, metadata = filled_caches(reference, FP8, k_scale=0.5, v_scale=0.25)
    got = reference.paged_attention(q, k_cache, v_cache, **metadata, k_scale=0.5, v_scale=0.25)
    want = reference.paged_attention(q, k_cache.float() * 0.5, v_cache.float() * 0.25, **metadata)
    torch.testing.assert_close(got, want)


@interpreted
def test_triton_fp8_cache_equals_reference():
    from hookllm.kernels import triton_attention

    q, k, v, k_cache, v_cache, slots, metadata = filled_caches(triton_attention, FP8, k_scale=0.5, v_scale=0.25)
    _, _, _, want_k, want_v, _, _ = filled_caches(reference, FP8, k_scale=0.5, v_scale=0.25)
    flat = lambda cache: cache.view(-1, KV_HEADS, DIM)[slots]  # noqa: E731
    assert_same_e4m3_where_rounding_stays_in_its_binade(flat(k_cache), flat(want_k), k / 0.5)
    assert_same_e4m3_where_rounding_stays_in_its_binade(flat(v_cache), flat(want_v), v / 0.25)
    got = triton_attention.paged_attention(q, k_cache, v_cache, **metadata, k_scale=0.5, v_scale=0.25)
    want = reference.paged_attention(q, k_cache, v_cache, **metadata, k_scale=0.5, v_scale=0.25)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
