"""The Triton kernels on CUDA at bf16, at realistic sizes, against their pure-torch references:
attention against float64 (relative error ||out - ref|| / ||ref|| < 1e-2), the per-layer ops
and the sampler against the reference in the same dtype (one bf16 ulp)."""

import pytest
import torch

from hookllm.kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # Every output (and split-K partial) starts as NaN: an element nothing wrote cannot pass.
    pytest.mark.usefixtures("poisoned_empty"),
]

if torch.cuda.is_available():
    from hookllm.kernels import triton_attention

DEVICE = "cuda"
BF16 = torch.bfloat16


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = BF16,
) -> dict:
    """Fresh random query and paged cache with shuffled block tables (unused entries -1)."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32, device=DEVICE)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEVICE)
    query_start_loc[1:] = torch.tensor(q_lens, device=DEVICE).cumsum(0)
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE).to(dtype),
        k_cache=torch.randn(shape, device=DEVICE).to(dtype),
        v_cache=torch.randn(shape, device=DEVICE).to(dtype),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=query_start_loc,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def reference_fp64(batch: dict, **variant) -> torch.Tensor:
    as64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    return reference.paged_attention(**as64, **variant)


def assert_close_to_reference(batch: dict, out: torch.Tensor, tol: float = 1e-2, **variant) -> None:
    expected = reference_fp64(batch, **variant)
    assert out.dtype == batch["query"].dtype
    assert not out.isnan().any(), "some output rows were never written"
    rel = (out.double() - expected).norm() / expected.norm()
    assert rel < tol, f"relative error {rel:.3e}"


def test_store_kv_writes_slots_and_skips_negative_ones():
    num_blocks, block_size, num_kv_heads, head_dim = 64, 16, 8, 128
    key = torch.randn(300, num_kv_heads, head_dim, device=DEVICE).to(BF16)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:300].to(torch.int32)
    slots[::7] = -1
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=BF16, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_attention.store_kv(key, value, k_cache, v_cache, slots)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache.isnan(), k_ref.isnan())
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_chunk_starting_mid_block_after_cached_context(head_dim):
    batch = make_batch(q_lens=[777], seq_lens=[3001 + 777], head_dim=head_dim)
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_from_empty_context(head_dim):
    batch = make_batch(q_lens=[2048, 300], seq_lens=[2048, 300], head_dim=head_dim)
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("window", [None, 65], ids=["bert", "modernbert-local"])
def test_bidirectional_prompts_of_an_encoder(window):
    # BERT-base's heads; ModernBERT's local layers see 64 tokens on each side.
    lens = [512, 16, 300, 77, 1]
    batch = make_batch(q_lens=lens, seq_lens=lens, num_heads=12, num_kv_heads=12, head_dim=64)
    out = triton_attention.paged_attention(**batch, causal=False, sliding_window=window)
    assert_close_to_reference(batch, out, causal=False, sliding_window=window)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 16), (32, 8), (32, 4)])
def test_gqa_query_heads_share_kv_heads(num_heads, num_kv_heads):
    batch = make_batch(
        q_lens=[300, 1, 1], seq_lens=[1000, 513, 2000], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64
    )
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_long_contexts_with_shuffled_block_tables(head_dim):
    batch = make_batch(q_lens=[1] * 40, seq_lens=[8192, 1, 4097, 333] * 10, head_dim=head_dim)
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


def test_mixed_batch_of_prefill_chunks_and_decodes():
    batch = make_batch(q_lens=[1, 512, 1, 0, 37, 1, 1000], seq_lens=[8000, 512, 17, 64, 4000, 2048, 1500])
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_k_path_for_few_long_decodes(head_dim):
    batch = make_batch(q_lens=[1, 1], seq_lens=[8192, 5000], head_dim=head_dim)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert triton_attention.num_kv_splits(2, 8, 1, 8192, sms) > 1
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("num_splits", [3, 64])
def test_split_k_with_forced_split_counts(num_splits):
    batch = make_batch(q_lens=[1, 1, 1], seq_lens=[8192, 100, 2049], head_dim=64)
    group = 32 // 8
    config = triton_attention.default_config(64, group, 1)
    args = {k: v for k, v in batch.items() if k != "max_seq_len"}
    out = triton_attention.paged_attention_with(**args, num_splits=num_splits, config=config)
    assert_close_to_reference(batch, out)


@pytest.mark.parametrize("head_dim", [32, 256])
def test_other_head_dims(head_dim):
    batch = make_batch(q_lens=[200, 1], seq_lens=[700, 1500], head_dim=head_dim)
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


def test_block_size_32():
    batch = make_batch(q_lens=[100, 1], seq_lens=[1234, 3000], block_size=32)
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    batch = make_batch(q_lens=[64, 1], seq_lens=[500, 900], head_dim=64, dtype=dtype)
    assert_close_to_reference(batch, triton_attention.paged_attention(**batch), tol=1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("rows", [3, 256], ids=["column-ranges", "whole-rows"])
def test_sample_with_hashed_noise_at_a_llama3_vocab_in_bf16(rows):
    from hookllm.kernels import triton_ops

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    vocab = 128256
    logits = (torch.randn(rows, vocab, device=DEVICE, generator=gen) * 4).to(BF16)
    temperature = torch.tensor([0.0 if r % 4 == 0 else 0.6 for r in range(rows)], device=DEVICE)
    keys = torch.randint(0, 2**32, (rows,), device=DEVICE, generator=gen)
    expected = reference.sample_with_hashed_noise(logits, temperature, keys)
    got = triton_ops.sample_with_hashed_noise(logits, temperature, keys)
    # The same noise bits; the logs' last float32 ulp may differ, so only a near-tie may pick another token.
    assert (got == expected).float().mean().item() > 0.99
    assert torch.equal(got[::4], logits[::4].argmax(dim=-1))


@pytest.mark.parametrize("spread", [4.0, 0.5], ids=["peaked", "flat"])
def test_filter_thresholds_at_a_llama3_vocab(spread):
    """256 rows of float32 logits (as the sampler gets them), each with its own mix of top-k,
    top-p and min-p: the kernel keeps the reference's tokens. Ranks are exact. A nucleus's edge
    and min-p's bound are float32 sums and logs taken in another order: on flat rows (nuclei of
    100k tokens of 1e-5 each) they may keep a few tokens more or fewer than the reference."""
    from hookllm.kernels import triton_ops

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows, vocab = 256, 128256
    logits = torch.randn(rows, vocab, device=DEVICE, generator=gen) * spread
    logits[::9, 1000:] = float("-inf")  # rows that a structured-output mask has narrowed
    pick = lambda values: torch.tensor(values, device=DEVICE)[torch.arange(rows, device=DEVICE) % len(values)]  # noqa: E731
    temperature = pick([0.0, 0.7, 1.0, 1.3])
    top_k, top_p, min_p = pick([0, 50, 1, 0, 2000, 20]), pick([1.0, 0.9, 0.95, 0.5, 1.0]), pick([0.0, 0.0, 0.05])
    args = (logits, temperature, top_k.float(), top_p, min_p, vocab, True)  # top_k a float, as the sampler has it
    want = (logits >= reference.filter_thresholds(*args)[:, None]).sum(dim=1)
    got = (logits >= triton_ops.filter_thresholds(*args)[:, None]).sum(dim=1)
    ranked_only = (top_p == 1.0) & (min_p == 0.0)
    assert torch.equal(got[ranked_only], want[ranked_only])
    assert ((got - want).abs() <= 2 + want // 1000).all()
    assert (got == want).float().mean().item() >= (0.99 if spread > 1 else 0.5)


def test_token_logprobs_at_a_llama3_vocab():
    """The chosen tokens' logprobs, ranks and the top 20 of 256 float32 rows: the torch reference's."""
    from hookllm.kernels import triton_ops

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows, vocab = 256, 128256
    logits = torch.randn(rows, vocab, device=DEVICE, generator=gen) * 4
    logits[::9, 1000:] = float("-inf")
    token_ids = torch.randint(0, 1000, (rows,), device=DEVICE, generator=gen)
    got = triton_ops.token_logprobs(logits, token_ids, 20)
    want = reference.token_logprobs(logits, token_ids, 20)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-4)
    assert (got[3] == want[3]).float().mean().item() > 0.99  # float32 near-ties may swap


def test_apply_penalties_at_a_llama3_vocab():
    from hookllm.kernels import triton_ops

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    slots, vocab = 64, 128256
    bias = torch.zeros(slots, vocab, device=DEVICE)
    bias[::3, :100] = float("-inf")
    counts = torch.randint(0, 3, (slots, vocab), device=DEVICE, generator=gen, dtype=torch.int32)
    prompt_mask = torch.rand(slots, vocab, device=DEVICE, generator=gen) < 0.01
    penalties = torch.tensor([0.5, 0.3, 1.2], device=DEVICE).repeat(slots, 1)
    logits = torch.randn(256, vocab, device=DEVICE, generator=gen) * 4
    rows = torch.randperm(256, device=DEVICE, generator=gen)[:slots]
    row_slots = torch.randperm(slots, device=DEVICE, generator=gen)
    expected, got = logits.clone(), logits.clone()
    reference.apply_penalties(expected, rows, row_slots, bias, counts, prompt_mask, penalties)
    triton_ops.apply_penalties(got, rows, row_slots, bias, counts, prompt_mask, penalties)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_apply_token_bitmask_at_a_llama3_vocab():
    from hookllm.kernels import triton_ops

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows, vocab, words = 256, 128256, 1000  # the mask narrower than the vocabulary, as a tokenizer's
    logits = torch.randn(rows, vocab, device=DEVICE, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (64, words), device=DEVICE, generator=gen, dtype=torch.int64).int()
    mask_rows = torch.randperm(rows, device=DEVICE, generator=gen)[:64]
    expected, got = logits.clone(), logits.clone()
    reference.apply_token_bitmask(expected, bitmask, mask_rows)
    triton_ops.apply_token_bitmask(got, bitmask, mask_rows)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("hidden", [2048, 4096])
def test_fused_add_rms_norm_in_bf16(hidden):
    from hookllm.kernels import triton_ops

    x, residual = (torch.randn(256, hidden, device=DEVICE).to(BF16) for _ in range(2))
    weight = (1 + torch.randn(hidden, device=DEVICE) / 4).to(BF16)
    expected = reference.rms_norm(x, weight, 1e-5, residual)
    got = triton_ops.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)  # the sum: one rounding, the same
    torch.testing.assert_close(got[0], expected[0], atol=1e-2, rtol=1e-2)  # one bf16 ulp


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_on_a_fused_qkv_view_in_bf16(head_dim):
    from hookllm.kernels import triton_ops
    from hookllm.layers.rotary import RotaryEmbedding

    q_size, kv_size = 32 * head_dim, 8 * head_dim
    qkv = torch.randn(300, q_size + 2 * kv_size, device=DEVICE).to(BF16)
    positions = torch.randint(0, 4096, (300,), device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 4096, 500000.0).to(DEVICE).cos_sin
    expected, got = qkv.clone(), qkv.clone()
    for fused, ops in ((expected, reference), (got, triton_ops)):
        q, k, _ = fused.split([q_size, kv_size, kv_size], dim=-1)
        ops.apply_rotary(positions, q, k, cos_sin, head_dim)
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_silu_and_mul_in_bf16():
    from hookllm.kernels import triton_ops

    gate_up = torch.randn(256, 2 * 8192, device=DEVICE).to(BF16)
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), atol=1e-2, rtol=1e-2)


def lora_batch(rows: int, k: int, widths: tuple[int, ...], slots: int = 8, rank: int = 16, seed: int = 0) -> dict:
    """Random bf16 activations and adapters; every fourth token in no slot, the others dealt over all
    slots but the last (left empty), grouped by slot in shuffled order."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    slice_starts = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
    tokens = torch.randperm(rows, device=DEVICE, generator=gen)
    adapted = tokens[tokens % 4 != 3]
    slot_of = torch.randint(0, slots - 1, (len(adapted),), device=DEVICE, generator=gen)
    order = adapted[torch.argsort(slot_of, stable=True)].to(torch.int32)
    counts = torch.bincount(slot_of, minlength=slots).to(torch.int32)
    return dict(
        x=torch.randn(rows, k, device=DEVICE, generator=gen).to(BF16),
        lora_a=(k ** -0.5 * torch.randn(slots, len(widths) * rank, k, device=DEVICE, generator=gen)).to(BF16),
        lora_b=(rank ** -0.5 * torch.randn(slots, slice_starts[-1], rank, device=DEVICE, generator=gen)).to(BF16),
        y=torch.randn(rows, slice_starts[-1], device=DEVICE, generator=gen).to(BF16),
        slice_starts=slice_starts,
        grouping=(order, (torch.cumsum(counts, 0) - counts).to(torch.int32), counts),
        base_rows=torch.arange(3, max(rows, 3), 4, device=DEVICE),  # none of a single row
    )


def lora_reference(batch: dict) -> torch.Tensor:
    """y plus each token's delta, all in float32."""
    want = batch["y"].float()
    shrunk = reference.lora_shrink(batch["x"].float(), batch["lora_a"].float(), *batch["grouping"])
    reference.lora_expand(want, shrunk, batch["lora_b"].float(), batch["slice_starts"], *batch["grouping"])
    return want


@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("k, widths", [(2048, (2048, 512, 512)), (2048, (2048,)), (2048, (8192, 8192)),
                                       (8192, (2048,))], ids=["qkv", "o", "gate_up", "down"])
def test_lora_shrink_then_expand_at_llama_1b_shapes_in_bf16(rows, k, widths):
    from hookllm.kernels import triton_lora

    batch = lora_batch(rows, k, widths)
    got = batch["y"].clone()
    shrunk = triton_lora.lora_shrink(batch["x"], batch["lora_a"], *batch["grouping"])
    triton_lora.lora_expand(got, shrunk, batch["lora_b"], batch["slice_starts"], *batch["grouping"])
    base = batch["base_rows"]
    assert torch.equal(got[base], batch["y"][base])
    torch.testing.assert_close(got.float(), lora_reference(batch), atol=1e-2, rtol=1e-2)  # one bf16 ulp


def test_lora_kernels_replay_in_a_cuda_graph_with_other_slot_counts():
    """The grids depend on the shapes only: a graph captured for one grouping of the tokens serves
    another written into the same tensors, and one where no token has an adapter."""
    from hookllm.kernels import triton_lora

    first, second = (lora_batch(64, 2048, (2048, 512, 512), seed=seed) for seed in (1, 2))
    order, starts, counts = first["grouping"]
    order = torch.cat([order, torch.zeros(64 - len(order), dtype=torch.int32, device=DEVICE)])
    y = first["y"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shrunk = triton_lora.lora_shrink(first["x"], first["lora_a"], order, starts, counts)
        triton_lora.lora_expand(y, shrunk, first["lora_b"], first["slice_starts"], order, starts, counts)
    for grouping in (second["grouping"], (order, starts, torch.zeros_like(counts))):
        y.copy_(first["y"])
        order[:len(grouping[0])].copy_(grouping[0])
        starts.copy_(grouping[1])
        counts.copy_(grouping[2])
        graph.replay()
        torch.testing.assert_close(y.float(), lora_reference(dict(first, grouping=grouping)), atol=1e-2, rtol=1e-2)
