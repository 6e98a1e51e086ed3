"""The Triton paged-attention kernels, run on the CPU by the Triton interpreter, against the
pure-torch reference (hookllm.kernels.reference) on tiny random shapes.

tests/conftest.py sets TRITON_INTERPRET=1 on machines without CUDA before anything imports
triton (the interpreter is chosen at import)."""

import pytest
import torch

from hookllm.kernels import reference
from hookllm.kernels import triton_attention

if torch.cuda.is_available():
    # There tests/gpu/test_kernels_gpu.py runs the compiled kernels; and triton < 3.7's interpreter
    # cannot take tensor loop bounds with numpy >= 2.4 (int() of a one-element array).
    pytest.skip("CUDA machine: the GPU kernel tests cover these kernels", allow_module_level=True)


# Every output (and split-K partial) starts as NaN: an element nothing wrote cannot pass.
pytestmark = pytest.mark.usefixtures("poisoned_empty")


def test_kernels_run_under_the_interpreter():
    assert type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """Random query and paged cache; each sequence's blocks are a random subset of the cache
    in random order, and unused block-table entries are -1."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def assert_matches_reference(batch: dict, out: torch.Tensor, atol: float = 1e-5) -> None:
    expected = reference.paged_attention(**batch)
    assert not out.isnan().any(), "some output rows were never written"
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=atol)


def run_with(batch: dict, num_splits: int = 1, config: triton_attention.AttentionConfig | None = None) -> torch.Tensor:
    """The kernels with an explicit split count and (default: the automatic) launch config."""
    if config is None:
        num_heads, head_dim = batch["query"].shape[1:]
        group = num_heads // batch["k_cache"].shape[2]
        config = triton_attention.default_config(head_dim, group, batch["max_query_len"])
    args = {k: v for k, v in batch.items() if k != "max_seq_len"}
    return triton_attention.paged_attention_with(**args, num_splits=num_splits, config=config)


def test_store_kv_writes_slots_and_skips_negative_ones():
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 4, 16, 3, 8
    key = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    slots = torch.tensor([17, -1, 0, 63, -1], dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    triton_attention.store_kv(key, value, k_cache, v_cache, slots)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True)
    assert k_cache.view(-1, num_kv_heads, head_dim).isnan().all(-1).all(-1).sum() == num_blocks * block_size - 3


def test_store_kv_casts_to_the_cache_dtype():
    key = torch.randn(2, 2, 16)
    value = torch.randn(2, 2, 16)
    k_cache = torch.zeros(1, 16, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    triton_attention.store_kv(key, value, k_cache, v_cache, torch.tensor([3, 5]))
    torch.testing.assert_close(k_cache[0, [3, 5]], key.to(torch.bfloat16))
    torch.testing.assert_close(v_cache[0, [3, 5]], value.to(torch.bfloat16))


def test_prefill_chunk_starting_mid_block_after_cached_context():
    batch = make_batch(q_lens=[13], seq_lens=[13 + 21])  # context 21: chunk starts at offset 5 of block 1
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


def test_prefill_from_empty_context():
    batch = make_batch(q_lens=[40], seq_lens=[40])
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_query_heads_share_kv_heads(group):
    batch = make_batch(q_lens=[5, 1], seq_lens=[37, 20], num_heads=2 * group, num_kv_heads=2)
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


def test_group_that_is_not_a_power_of_two():
    batch = make_batch(q_lens=[9, 1], seq_lens=[30, 18], num_heads=6, num_kv_heads=2)
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


def test_sequence_spanning_many_blocks_with_shuffled_block_table():
    batch = make_batch(q_lens=[3], seq_lens=[16 * 23 + 7])
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


def test_mixed_batch_of_prefill_chunks_and_decodes():
    batch = make_batch(q_lens=[1, 33, 1, 7, 0, 1], seq_lens=[45, 33, 1, 70, 12, 16])
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


def test_a_mixed_batch_padded_as_its_cuda_graph_pads_it_gives_the_same_rows():
    # hookllm.worker.cuda_graph: tokens padded to the bucket and owned by no sequence, sequences padded
    # with no query and no context, the launch shaped for the longest query.
    batch = make_batch(q_lens=[1, 11, 1, 5], seq_lens=[9, 30, 40, 27])
    expected = reference.paged_attention(**batch)
    tokens, seqs, padded_tokens, padded_seqs = 18, 4, 24, 8
    padded = dict(batch, max_query_len=2048, max_seq_len=2048)
    padded["query"] = torch.cat([batch["query"], torch.randn(padded_tokens - tokens, *batch["query"].shape[1:])])
    padded["seq_lens"] = torch.cat([batch["seq_lens"], torch.zeros(padded_seqs - seqs, dtype=torch.int32)])
    padded["query_start_loc"] = torch.cat([batch["query_start_loc"],
                                           torch.full((padded_seqs - seqs,), tokens, dtype=torch.int32)])
    padded["block_tables"] = torch.cat([batch["block_tables"],
                                        torch.zeros(padded_seqs - seqs, batch["block_tables"].shape[1], dtype=torch.int32)])
    out = triton_attention.paged_attention(**padded)
    torch.testing.assert_close(out[:tokens], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [2, 4])
def test_prefill_chunks_spread_over_several_query_blocks(block_m):
    # Small tiles so that each chunk needs several programs; the diagonal crosses key tiles.
    config = triton_attention.AttentionConfig(block_m=block_m, block_n=16, num_warps=4, num_stages=1)
    batch = make_batch(q_lens=[1, 11, 0, 5, 1, 9], seq_lens=[9, 30, 4, 5, 40, 27])
    assert_matches_reference(batch, run_with(batch, config=config))


def test_decode_only_batch():
    batch = make_batch(q_lens=[1, 1, 1, 1], seq_lens=[1, 17, 63, 64], head_dim=16)
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_decode_matches_reference(num_splits):
    # 5 splits of a 150-key sequence leave some splits empty: they must not disturb the merge.
    batch = make_batch(q_lens=[1, 1, 1], seq_lens=[150, 33, 3], num_heads=8, num_kv_heads=2)
    assert_matches_reference(batch, run_with(batch, num_splits))


def test_split_k_is_chosen_only_for_long_decodes_that_underfill_the_gpu():
    sms = 132
    assert triton_attention.num_kv_splits(1, 8, 1, 8192, sms) > 1
    assert triton_attention.num_kv_splits(256, 8, 1, 8192, sms) == 1  # enough programs already
    assert triton_attention.num_kv_splits(1, 8, 1, 200, sms) == 1  # context too short to split
    assert triton_attention.num_kv_splits(1, 8, 16, 8192, sms) == 1  # not decode-only


def test_block_size_32_with_head_dim_64():
    batch = make_batch(q_lens=[19, 1], seq_lens=[50, 75], head_dim=64, block_size=32)
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


def test_head_dim_smaller_than_the_dot_minimum():
    batch = make_batch(q_lens=[4, 1], seq_lens=[20, 9], head_dim=8)
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


def test_strided_query_view_of_a_fused_qkv_tensor():
    batch = make_batch(q_lens=[6, 1], seq_lens=[22, 40])
    qkv = torch.randn(7, 4 + 2 + 2, 32)
    qkv[:, :4] = batch["query"]
    batch["query"] = qkv[:, :4]
    assert not batch["query"].is_contiguous()
    assert_matches_reference(batch, triton_attention.paged_attention(**batch))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    batch = make_batch(q_lens=[5, 1], seq_lens=[27, 40], dtype=dtype)
    out = triton_attention.paged_attention(**batch)
    assert out.dtype == dtype
    assert_matches_reference(batch, out, atol=2e-2)


def test_tiny_model_on_the_triton_backend_matches_transformers_greedy(tiny_llama_dir, tiny_llama_reference):
    from hookllm import LLM, testing

    # A small token budget mixes prefill chunks that start after cached context with decodes.
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", attention_backend="triton",
              max_num_batched_tokens=16)
    assert llm.engine.engine_core.executor.attention_backend is triton_attention
    prompts = testing.random_prompts(3, 320, min_len=4, max_len=30, seed=5)
    testing.assert_greedy_matches(llm, tiny_llama_reference, prompts, max_tokens=6)


def tolerance(dtype: torch.dtype) -> dict:
    # The interpreter casts fp32 to bf16 by truncation, not rounding: a few bf16 ulps apart.
    return dict(atol=1e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


def sampling_inputs(rows: int, vocab: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple:
    """Random logits with some banned (-inf) tokens, every other row greedy, and 32-bit noise
    keys (the largest ones included: the kernel hashes them as unsigned words)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[:, ::7] = float("-inf")
    temperature = torch.tensor([0.0 if r % 2 else 0.5 + r / rows for r in range(rows)])
    keys = torch.randint(0, 2**32, (rows,), generator=gen)
    keys[0] = 2**32 - 1
    return logits, temperature, keys


@pytest.fixture(params=["whole-rows", "column-ranges"])
def sampler_splits(request, monkeypatch):
    """The sampling kernel with one program per row, or with rows cut into column ranges (as
    it runs when a few rows would leave most SMs idle)."""
    from hookllm.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "SAMPLER_PROGRAMS_PER_SM", 0 if request.param == "whole-rows" else 1000)
    return request.param


@pytest.mark.parametrize("vocab", [97, 5000], ids=["one-block", "several-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_with_hashed_noise_kernel_matches_reference(vocab, dtype, sampler_splits):
    from hookllm.kernels import triton_ops

    logits, temperature, keys = sampling_inputs(6, vocab, dtype)
    expected = reference.sample_with_hashed_noise(logits, temperature, keys)
    assert torch.equal(triton_ops.sample_with_hashed_noise(logits, temperature, keys), expected)
    assert torch.equal(expected[1::2], logits[1::2].float().argmax(dim=-1))  # greedy rows ignore the noise


def test_sample_with_hashed_noise_kernel_draws_from_the_distribution_the_reference_does():
    # Many keys over one row: the kernel's draws equal the reference's key by key, so their
    # frequencies follow softmax(logits) as the reference's do (tests/test_sampling.py).
    from hookllm.kernels import triton_ops

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(64, 1)
    keys = torch.randint(0, 2**32, (64,), generator=torch.Generator().manual_seed(3))
    temperature = torch.ones(64)
    expected = reference.sample_with_hashed_noise(logits, temperature, keys)
    assert torch.equal(triton_ops.sample_with_hashed_noise(logits, temperature, keys), expected)
    assert len(set(expected.tolist())) > 1


def test_sample_with_hashed_noise_kernel_reads_each_row_temperature_from_a_strided_view():
    from hookllm.kernels import triton_ops

    logits, _, keys = sampling_inputs(8, 97, torch.float32)
    # The sampler passes column 0 of its [rows, 4] parameter table; the other columns read as
    # temperatures would make rows greedy.
    table = torch.zeros(8, 4)
    table[:, 0] = 5.0
    expected = reference.sample_with_hashed_noise(logits, table[:, 0].clone(), keys)
    assert not torch.equal(expected, logits.argmax(dim=-1))
    assert torch.equal(triton_ops.sample_with_hashed_noise(logits, table[:, 0], keys), expected)


def test_sample_with_hashed_noise_kernel_leaves_out_logits_below_each_row_threshold(sampler_splits):
    """Row thresholds (the sampler's top-k / top-p / min-p): sampled rows draw only logits at or
    above theirs, greedy rows ignore it; as the reference does, token for token."""
    from hookllm.kernels import triton_ops

    logits, temperature, keys = sampling_inputs(6, 5000, torch.float32)
    threshold = logits.float().topk(3, dim=-1).values[:, 2]  # each row's third largest logit
    expected = reference.sample_with_hashed_noise(logits, temperature, keys, threshold)
    assert torch.equal(triton_ops.sample_with_hashed_noise(logits, temperature, keys, threshold), expected)
    sampled = temperature > 0
    assert (logits.gather(1, expected[:, None]).squeeze(1)[sampled] >= threshold[sampled]).all()
    assert torch.equal(expected[~sampled], logits[~sampled].argmax(dim=-1))


def test_sample_with_hashed_noise_kernel_picks_the_first_of_tied_maxima(sampler_splits):
    from hookllm.kernels import triton_ops

    logits = torch.zeros(2, 3000)
    logits[:, [5, 2100, 2999]] = 1.0  # in different lanes, blocks and column ranges
    temperature, keys = torch.zeros(2), torch.zeros(2, dtype=torch.long)
    assert triton_ops.sample_with_hashed_noise(logits, temperature, keys).tolist() == [5, 5]


@pytest.fixture
def small_filter_lanes(monkeypatch):
    """The filter kernel with 64 lanes and room for 64 candidates, so that rows of a few hundred
    logits take each of its paths: candidates, too many candidates, a nucleus beyond them."""
    from hookllm.kernels import triton_ops

    for name, value in [("FILTER_LANES", 64), ("FILTER_CAPACITY", 64), ("FILTER_TOP_P_RANK", 16),
                        ("FILTER_SEARCH_LANES", 64), ("NUCLEUS_LANES", 32)]:
        monkeypatch.setattr(triton_ops, name, value)


FILTER_CASES = {
    "top-k among the candidates": dict(top_k=[5, 0, 40, 1]),
    "top-k above the lanes: exact search": dict(top_k=[100, 65, 300, 2]),
    "top-p within its candidates": dict(top_p=[0.5, 0.9, 0.99, 1.0]),
    "top-p beyond its candidates: exact search": dict(top_p=[0.5, 0.9, 0.99, 0.3], spread=0.05),
    "top-p beyond its candidates, a logit at the float minimum": dict(top_p=[0.5, 0.9, 0.999, 0.3], spread=0.05,
                                                                      lowest=True),
    "top-k of nearly the whole row": dict(top_k=[499, 450, 300, 498]),
    "top-p within top-k": dict(top_k=[50, 20, 3, 50], top_p=[0.9, 0.5, 0.95, 1.0]),
    "min-p": dict(min_p=[0.05, 0.2, 0.5, 0.0]),
    "all three, a greedy row": dict(top_k=[50, 0, 10, 0], top_p=[0.9, 1.0, 0.8, 0.7], min_p=[0.1, 0.05, 0.0, 0.0],
                                    greedy_row=1),
    "many ties": dict(top_k=[5, 30, 0, 0], top_p=[1.0, 0.9, 0.6, 0.95], ties=True),
    "few finite logits": dict(top_k=[50, 5, 0, 0], top_p=[0.9, 1.0, 0.5, 1.0], min_p=[0.0, 0.0, 0.0, 0.1], finite=10),
}


@pytest.mark.parametrize("case", FILTER_CASES.values(), ids=FILTER_CASES.keys())
def test_filter_thresholds_kernel_keeps_what_the_reference_keeps(case, small_filter_lanes):
    from hookllm.kernels import triton_ops

    gen = torch.Generator().manual_seed(len(FILTER_CASES))
    logits = torch.randn(4, 500, generator=gen) * 3 * case.get("spread", 1.0)
    if case.get("ties"):
        logits = logits.round()
    if case.get("lowest"):
        logits[:, 7] = torch.finfo(torch.float32).min  # a range of many binades to search
    if "finite" in case:
        logits[:, case["finite"]:] = float("-inf")  # as a structured-output mask leaves them
    temperature = torch.full((4,), 0.7)
    temperature[case.get("greedy_row", 4):case.get("greedy_row", 4) + 1] = 0.0
    top_k = torch.tensor(case.get("top_k", [0] * 4))
    top_p = torch.tensor(case.get("top_p", [1.0] * 4))
    min_p = torch.tensor(case.get("min_p", [0.0] * 4))
    has_top_p = top_p < 1.0
    needed = 500 if bool((has_top_p & (top_k <= 0)).any()) else int(top_k.max())
    # top_k as a float, as the sampler's table holds it.
    args = (logits, temperature, top_k.float(), top_p, min_p, needed, bool(has_top_p.any()))
    want = logits >= reference.filter_thresholds(*args)[:, None]
    assert torch.equal(logits >= triton_ops.filter_thresholds(*args)[:, None], want)


@pytest.mark.parametrize("num_top", [0, 1, 3, 20])
def test_token_logprobs_kernel_matches_log_softmax(num_top, monkeypatch):
    from hookllm.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "TOKEN_LOGPROBS_LANES", 64)  # several tiles per row, interpreted quickly
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen) * 3
    logits[3, 50:] = float("-inf")  # a row a structured-output mask has narrowed
    token_ids = torch.tensor([7, 299, 0, 12])
    logprob, rank, top_values, top_ids = triton_ops.token_logprobs(logits, token_ids, num_top)
    want = logits.log_softmax(dim=-1)
    torch.testing.assert_close(logprob, want.gather(1, token_ids[:, None]).squeeze(1), rtol=0, atol=1e-5)
    assert rank.tolist() == [int((row > row[t]).sum()) + 1 for row, t in zip(logits, token_ids.tolist())]
    expected_values, expected_ids = want.topk(num_top, dim=-1)
    torch.testing.assert_close(top_values, expected_values, rtol=0, atol=1e-5)
    assert torch.equal(top_ids, expected_ids)


@pytest.mark.parametrize("capacity", [128, 4], ids=["candidates", "exact search"])
def test_token_logprobs_top_ones_with_ties_and_few_finite_logits(capacity, monkeypatch):
    """Tied logits are reported lowest id first; a row with fewer finite logits than asked
    reports them, then -inf at the lowest ids of the rest. With a capacity of 4 candidates the
    rows overflow it and take the exact search."""
    from hookllm.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "TOKEN_LOGPROBS_LANES", 32)
    monkeypatch.setattr(triton_ops, "TOKEN_LOGPROBS_CAPACITY", capacity)
    logits = torch.full((3, 100), float("-inf"))
    logits[0] = torch.arange(100) % 7  # values 0..6, each about 14 times
    logits[1, [90, 3, 41]] = torch.tensor([2.0, 1.0, 2.0])
    logits[2] = 1.5  # all equal
    _, _, top_values, top_ids = triton_ops.token_logprobs(logits, torch.tensor([0, 3, 99]), 8)
    want = logits.log_softmax(dim=-1)
    assert top_ids[0].tolist() == [6, 13, 20, 27, 34, 41, 48, 55]
    assert top_ids[1].tolist() == [41, 90, 3, 0, 1, 2, 4, 5]
    assert top_ids[2].tolist() == list(range(8))
    torch.testing.assert_close(top_values, want.gather(1, top_ids), rtol=0, atol=1e-5)


def test_apply_penalties_kernel_matches_reference():
    from hookllm.kernels import triton_ops

    gen = torch.Generator().manual_seed(0)
    slots, vocab = 4, 300
    bias = torch.zeros(slots, vocab)
    bias[1, ::5] = float("-inf")
    bias[2, :7] = 2.5
    counts = torch.randint(0, 3, (slots, vocab), generator=gen, dtype=torch.int32)
    prompt_mask = torch.rand(slots, vocab, generator=gen) < 0.1
    penalties = torch.tensor([[0.5, 0.2, 1.3], [0.0, 0.0, 1.0], [1.0, 0.0, 0.8], [0.0, 0.7, 1.7]])
    logits = torch.randn(5, vocab, generator=gen) * 3
    rows, row_slots = torch.tensor([4, 0, 2]), torch.tensor([3, 1, 0])
    expected = logits.clone()
    reference.apply_penalties(expected, rows, row_slots, bias, counts, prompt_mask, penalties)
    triton_ops.apply_penalties(logits, rows, row_slots, bias, counts, prompt_mask, penalties)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits[[1, 3]], expected[[1, 3]])  # rows without a slot are left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-and-norm"])
def test_rms_norm_kernel_matches_reference(dtype, with_residual):
    from hookllm.kernels import triton_ops

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen).to(dtype)  # hidden not a power of two
    residual = torch.randn(5, 96, generator=gen).to(dtype) if with_residual else None
    weight = (1 + torch.randn(96, generator=gen) / 4).to(dtype)
    expected = reference.rms_norm(x, weight, 1e-5, residual)
    got = triton_ops.rms_norm(x, weight, 1e-5, residual)
    for e, g in zip(expected if with_residual else [expected], got if with_residual else [got]):
        torch.testing.assert_close(g, e, **tolerance(dtype))


@pytest.mark.parametrize("head_dim", [16, 24], ids=["pow2", "not-pow2"])
def test_rotary_kernel_matches_reference_on_strided_views_of_fused_qkv(head_dim):
    from hookllm.kernels import triton_ops

    gen = torch.Generator().manual_seed(2)
    num_tokens, q_size, kv_size = 6, 4 * head_dim, 2 * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)
    positions = torch.tensor([0, 1, 2, 7, 30, 31])
    cos_sin = torch.randn(32, head_dim, generator=gen)
    expected, got = qkv.clone(), qkv.clone()
    for fused, ops in ((expected, reference), (got, triton_ops)):
        q, k, _ = fused.split([q_size, kv_size, kv_size], dim=-1)
        ops.apply_rotary(positions, q, k, cos_sin, head_dim)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, q_size + kv_size:], qkv[:, q_size + kv_size:])  # v untouched


def test_reference_rotary_of_fused_qkv_views_equals_rotating_q_and_k_apart():
    gen = torch.Generator().manual_seed(4)
    head_dim, q_size, kv_size = 8, 32, 16
    qkv = torch.randn(5, q_size + 2 * kv_size, generator=gen)
    positions, cos_sin = torch.tensor([0, 3, 4, 9, 2]), torch.randn(10, head_dim, generator=gen)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)  # k's heads follow q's: rotated as one
    apart_q, apart_k = q.clone(), k.clone()
    reference.apply_rotary(positions, q, k, cos_sin, head_dim)
    reference.apply_rotary(positions, apart_q, apart_k, cos_sin, head_dim)
    assert torch.equal(q, apart_q) and torch.equal(k, apart_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_kernel_matches_reference(dtype):
    from hookllm.kernels import triton_ops

    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(3)).to(dtype)  # two column blocks
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tolerance(dtype))


def token_bitmask_inputs(rows: int, vocab: int, words: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (rows // 2, words), generator=gen, dtype=torch.int64).to(torch.int32)
    mask_rows = torch.randperm(rows, generator=gen)[:rows // 2]
    return logits, bitmask, mask_rows


@pytest.mark.parametrize("vocab, words", [(100, 4), (100, 3), (2100, 66)],
                         ids=["vocab-inside-the-mask", "vocab-past-the-mask", "several-blocks"])
def test_apply_token_bitmask_kernel_matches_reference(vocab, words):
    from hookllm.kernels import triton_ops

    logits, bitmask, rows = token_bitmask_inputs(8, vocab, words)
    expected, got = logits.clone(), logits.clone()
    reference.apply_token_bitmask(expected, bitmask, rows)
    triton_ops.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)


def test_apply_token_bitmask_reference_follows_the_bit_layout():
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | -(1 << 31)  # tokens 3 and 31 (bit 31 is the sign bit)
    bitmask[0, 1] = 1 << 1  # token 33; tokens 64..69 lie past the mask's two words
    reference.apply_token_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 31, 33]
    assert torch.isfinite(logits[[0, 2]]).all()  # rows without a mask are untouched
