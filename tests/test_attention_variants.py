"""Sliding window, logit soft-capping, attention sinks and bidirectional attention in paged attention: the torch reference
against a dense computation written here, the Triton kernels (the interpreter on the CPU, compiled
on CUDA; tiny shapes) against the reference, and the Attention layer passing them on.

Every cache slot that holds no live key is NaN, blocks wholly before every query's window
included (their block-table entries point at one stale block, or are -1): a kernel that reads
a key it must not see fails."""

from types import SimpleNamespace

import pytest
import torch

from hookllm.worker.forward_context import AttentionMetadata, set_forward_context
from hookllm.kernels import reference, triton_attention
from hookllm.layers.attention import Attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Every output (and split-K partial) starts as NaN: an element nothing wrote cannot pass.
pytestmark = pytest.mark.usefixtures("poisoned_empty")

VARIANTS = ["window", "softcap", "sinks", "window+softcap+sinks"]
MIXED = dict(q_lens=[1, 13, 1, 30, 7], seq_lens=[45, 34, 150, 30, 70])  # decodes, chunks after context, a prompt
DECODES = dict(q_lens=[1, 1, 1], seq_lens=[150, 33, 3])
# Small tiles: several query blocks per chunk and several key tiles in each region
# (window-masked, unmasked, causal-masked).
SMALL_TILES = triton_attention.AttentionConfig(block_m=4, block_n=16, num_warps=4, num_stages=1)
DECODE_TILES = triton_attention.AttentionConfig(block_m=1, block_n=16, num_warps=4, num_stages=1)


def variant_kwargs(name: str, num_heads: int, window: int = 8) -> dict:
    """The keyword arguments of a variant; sinks include one far above every score."""
    kwargs: dict = {}
    if "window" in name:
        kwargs["sliding_window"] = window
    if "softcap" in name:
        kwargs["softcap"] = 2.0
    if "sinks" in name:
        sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(7))
        sinks[0] = 20.0
        kwargs["sinks"] = sinks.to(DEVICE)
    return kwargs


def paged_batch(q_lens: list[int], seq_lens: list[int], window: int | None = None, num_heads: int = 4,
                num_kv_heads: int = 2, head_dim: int = 32, block_size: int = 16, dead_table_entry: str = "stale",
                dead_value: float = float("nan")) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """A batch, and each sequence's keys and values ``[seq_len, num_kv_heads, head_dim]``.

    The paged cache holds only the live keys (from the first in the window of the sequence's
    first query on), in shuffled blocks; every other slot holds ``dead_value``. The blocks
    wholly before the window are one shared stale block (``dead_table_entry="stale"``) or -1."""
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    firsts = [0 if window is None else max(0, s - q - window + 1) for q, s in zip(q_lens, seq_lens)]
    live_blocks = [-(-s // block_size) - f // block_size for s, f in zip(seq_lens, firsts)]
    num_blocks = sum(live_blocks) + 2  # the stale block and a free one
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, dead_value), torch.full(shape, dead_value)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    stale = perm.pop()
    block_tables = torch.full((len(seq_lens), max(-(-s // block_size) for s in seq_lens)), -1, dtype=torch.int32)
    for i, (seq_len, first) in enumerate(zip(seq_lens, firsts)):
        block_tables[i, : first // block_size] = stale if dead_table_entry == "stale" else -1
        for b in range(first // block_size, -(-seq_len // block_size)):
            block_tables[i, b] = perm.pop()
        for t in range(first, seq_len):
            k_cache[block_tables[i, t // block_size], t % block_size] = keys[i][t]
            v_cache[block_tables[i, t // block_size], t % block_size] = values[i][t]
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    batch = dict(
        query=3 * torch.randn(sum(q_lens), num_heads, head_dim, generator=gen),  # scores large enough to cap
        k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=query_start_loc,
    )
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    batch.update(max_query_len=max(q_lens), max_seq_len=max(seq_lens), scale=head_dim**-0.5)
    return batch, keys, values


def dense_attention(batch: dict, keys: list[torch.Tensor], values: list[torch.Tensor], sliding_window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Each query row over exactly the keys it sees, in float64, the sink's term written out:
    causal, the keys up to its own; bidirectional, every key of its sequence (within the window,
    on both sides)."""
    query = batch["query"].cpu().double()
    num_heads = query.shape[1]
    out = torch.empty_like(query)
    starts = batch["query_start_loc"].tolist()
    for i, (k, v) in enumerate(zip(keys, values)):
        group = num_heads // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            pos = k.shape[0] - q_len + j
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            end = pos + 1 if causal else k.shape[0] if sliding_window is None else min(k.shape[0], pos + sliding_window)
            scores = torch.einsum("hd,khd->hk", query[starts[i] + j], k[first:end]) * batch["scale"]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            m = scores.max(dim=1).values
            if sinks is not None:
                m = torch.maximum(m, sinks.cpu().double())
            weights = torch.exp(scores - m[:, None])
            denominator = weights.sum(dim=1)
            if sinks is not None:
                denominator = denominator + torch.exp(sinks.cpu().double() - m)
            out[starts[i] + j] = torch.einsum("hk,khd->hd", weights / denominator[:, None], v[first:end])
    return out.float()


def run_triton(batch: dict, num_splits: int = 1, config: triton_attention.AttentionConfig | None = None,
               **variant) -> torch.Tensor:
    """The public kernel entry, or with a split count and config forced."""
    if config is None:
        return triton_attention.paged_attention(**batch, **variant)
    args = {k: v for k, v in batch.items() if k != "max_seq_len"}
    return triton_attention.paged_attention_with(**args, num_splits=num_splits, config=config, **variant)


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any(), "an output was never written, or a key it must not see was read"
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_reference_matches_dense_attention_on_a_mixed_batch(name):
    variant = variant_kwargs(name, num_heads=4)
    batch, keys, values = paged_batch(**MIXED, window=variant.get("sliding_window"))
    assert_close(reference.paged_attention(**batch, **variant), dense_attention(batch, keys, values, **variant))


def test_reference_without_variants_matches_dense_causal_attention():
    batch, keys, values = paged_batch(**MIXED)
    assert_close(reference.paged_attention(**batch), dense_attention(batch, keys, values))


def test_reference_window_wider_than_every_sequence_is_plain_causal_attention():
    batch, _, _ = paged_batch(**MIXED)
    assert torch.equal(reference.paged_attention(**batch, sliding_window=150), reference.paged_attention(**batch))


def test_reference_window_of_one_token_gives_each_token_its_own_value():
    batch, _, values = paged_batch(**MIXED, window=1, num_heads=2, num_kv_heads=2)
    starts = batch["query_start_loc"].tolist()
    own = torch.cat([v[-(starts[i + 1] - starts[i]):] for i, v in enumerate(values)])
    torch.testing.assert_close(reference.paged_attention(**batch, sliding_window=1).cpu(), own)


@pytest.mark.parametrize("name", VARIANTS)
def test_triton_matches_reference_on_a_mixed_batch(name):
    variant = variant_kwargs(name, num_heads=4)
    batch, _, _ = paged_batch(**MIXED, window=variant.get("sliding_window"))
    assert_close(run_triton(batch, **variant), reference.paged_attention(**batch, **variant))


@pytest.mark.parametrize("name", VARIANTS)
def test_triton_with_small_tiles_matches_reference(name):
    # A 40-key window over 16-key tiles: each program has window-masked, unmasked and causal tiles.
    variant = variant_kwargs(name, num_heads=4, window=40)
    batch, _, _ = paged_batch(**MIXED, window=variant.get("sliding_window"))
    assert_close(run_triton(batch, config=SMALL_TILES, **variant), reference.paged_attention(**batch, **variant))


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("name", VARIANTS)
def test_triton_split_k_matches_reference(name, num_splits):
    # 5 splits of the 54 keys from the 150-key sequence's first window tile leave a split empty.
    variant = variant_kwargs(name, num_heads=8, window=40)
    batch, _, _ = paged_batch(**DECODES, window=variant.get("sliding_window"), num_heads=8)
    assert_close(run_triton(batch, num_splits, DECODE_TILES, **variant), reference.paged_attention(**batch, **variant))


@pytest.mark.parametrize("dead_table_entry", ["stale", "-1"])
@pytest.mark.parametrize("path", ["reference", "triton", "triton-split-k"])
def test_blocks_before_the_window_do_not_change_the_output(path, dead_table_entry):
    run = {"reference": lambda b: reference.paged_attention(**b, sliding_window=20),
           "triton": lambda b: run_triton(b, config=SMALL_TILES, sliding_window=20),
           "triton-split-k": lambda b: run_triton(b, 3, DECODE_TILES, sliding_window=20)}[path]
    shape = DECODES if path == "triton-split-k" else MIXED
    finite, _, _ = paged_batch(**shape, window=20, dead_value=0.5)
    poisoned, _, _ = paged_batch(**shape, window=20, dead_table_entry=dead_table_entry)
    assert poisoned["k_cache"].isnan().any()
    out = run(poisoned)
    assert not out.isnan().any()
    assert torch.equal(out, run(finite))


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
def test_triton_sinks_in_the_model_dtype(split):
    sinks = variant_kwargs("sinks", num_heads=8)["sinks"].to(torch.bfloat16)
    batch, _, _ = paged_batch(**DECODES, num_heads=8)
    out = run_triton(batch, 4, DECODE_TILES, sinks=sinks) if split else run_triton(batch, sinks=sinks)
    assert_close(out, reference.paged_attention(**batch, sinks=sinks.float()))


def test_a_windowed_decode_is_split_by_the_keys_it_reads(monkeypatch):
    # With a window of 20 a decode reads 20 keys however long its sequence: the split count follows.
    seen = []
    real = triton_attention.num_kv_splits
    monkeypatch.setattr(triton_attention, "num_kv_splits", lambda *args: seen.append(args[3]) or real(*args))
    batch, _, _ = paged_batch(**DECODES)
    run_triton(batch, sliding_window=20)
    run_triton(batch)
    assert seen == [20, 150]


def backend_calls(*layers: tuple[Attention, torch.Tensor | None]) -> list[dict]:
    """The keyword arguments each ``(layer, sinks)`` passes to the backend's paged_attention on a
    3-token step (4 query heads, 2 KV heads of 8)."""
    calls = []
    backend = SimpleNamespace(store_kv=lambda *args: None,
                              paged_attention=lambda *args, **kwargs: calls.append(kwargs) or args[0])
    metadata = AttentionMetadata(slot_mapping=(torch.zeros(3, dtype=torch.long),), block_tables=(torch.zeros(1, 1),),
                                 seq_lens=torch.tensor([3]), query_start_loc=torch.tensor([0, 3]),
                                 max_query_len=3, max_seq_len=3, backend=backend)
    q, kv = torch.zeros(3, 4 * 8), torch.zeros(3, 2 * 8)
    with set_forward_context(metadata):
        for layer, sinks in layers:
            layer(q, kv, kv, sinks=sinks)
    return calls


def test_attention_layer_passes_its_variants_and_the_sinks_to_the_backend():
    sinks = torch.ones(4)
    windowed = Attention(4, 8, 0.5, 2, sliding_window=128, softcap=30.0)
    windowed.k_scale, windowed.v_scale = 0.5, 0.25  # an FP8 cache's per-layer scales
    calls = backend_calls((Attention(4, 8, 0.5, 2), None), (windowed, sinks))
    assert calls[0] == dict(sliding_window=None, softcap=None, sinks=None, k_scale=1.0, v_scale=1.0, causal=True)
    assert calls[1] == dict(sliding_window=128, softcap=30.0, sinks=sinks, k_scale=0.5, v_scale=0.25, causal=True)


# Encoders: whole prompts (a query sees keys after its own), and chunks after a context.
PROMPTS = dict(q_lens=[13, 1, 40, 7, 30], seq_lens=[13, 1, 40, 20, 30])
BIDIRECTIONAL = ["plain", "window"]


@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_bidirectional_reference_matches_dense_attention(name):
    variant = variant_kwargs(name, num_heads=4, window=6)
    batch, keys, values = paged_batch(**PROMPTS, window=variant.get("sliding_window"))
    expected = dense_attention(batch, keys, values, causal=False, **variant)
    assert_close(reference.paged_attention(**batch, causal=False, **variant), expected)


def test_bidirectional_attention_of_a_prompt_differs_from_causal_but_not_at_its_last_token():
    batch, _, _ = paged_batch(q_lens=[9], seq_lens=[9])
    both, causal = reference.paged_attention(**batch, causal=False), reference.paged_attention(**batch)
    assert not torch.allclose(both[:-1], causal[:-1])
    torch.testing.assert_close(both[-1], causal[-1])


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_bidirectional_triton_matches_reference(name, tiles):
    # A 20-key window over 16-key tiles: rows' windows start and end inside tiles on both sides.
    variant = variant_kwargs(name, num_heads=4, window=20)
    batch, _, _ = paged_batch(**PROMPTS, window=variant.get("sliding_window"))
    out = run_triton(batch, config=SMALL_TILES if tiles == "small" else None, causal=False, **variant)
    assert_close(out, reference.paged_attention(**batch, causal=False, **variant))


def test_attention_layer_passes_bidirectional_to_the_backend():
    assert backend_calls((Attention(4, 8, 0.5, 2, causal=False), None))[0]["causal"] is False
