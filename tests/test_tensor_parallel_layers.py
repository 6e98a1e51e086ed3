"""Tensor parallelism on the CPU: two gloo ranks in spawned processes reproduce TP=1 and
transformers; each rank holds (and reads) only its shards; the opt-in and shape checks."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import tp_helpers
from hookllm import distributed, testing
from hookllm.adapters.llama.model import LlamaForCausalLM
from hookllm.config import EngineConfig, load_hf_config
from hookllm.distributed import check_tensor_parallel
from hookllm.layers import (
    ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
    VocabParallelEmbedding,
)

WORLD = 2
HIDDEN, INTERMEDIATE, HEADS = tp_helpers.HIDDEN, tp_helpers.INTERMEDIATE, tp_helpers.HEADS
CASES = tp_helpers.CASES
PROMPTS = testing.random_prompts(3, 301, min_len=5, max_len=40, seed=5)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Every case (and the dummy format) run once on two ranks: (checkpoint paths, per-rank results)."""
    root = tmp_path_factory.mktemp("tp")
    cases = {}
    for name, make in CASES.items():
        path = testing.build_tiny_checkpoint(make(), root / name)
        tp_helpers.randomize_biases(path)
        cases[name] = str(path)
    dummy = root / "dummy"  # a config.json and no weights: the dummy format must not read any
    dummy.mkdir()
    shutil.copy(root / "llama-gqa-bias" / "config.json", dummy)
    out = root / "out"
    out.mkdir()
    tp_helpers.run_ranks(tp_helpers.tp_worker, WORLD,
                         (WORLD, f"file://{root}/init", cases, PROMPTS, str(dummy), str(out)))
    return cases, [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_logits_match_tp1_and_transformers(tp_run, case):
    cases, ranks = tp_run
    tp1 = tp_helpers.paged_logits(tp_helpers.build_model(Path(cases[case])), PROMPTS)
    reference = testing.load_reference(cases[case])
    with torch.inference_mode():
        hf = torch.cat([reference(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert (tp1 - hf).abs().max() < testing.LOGITS_ATOL
    for rank, results in enumerate(ranks):
        tp2 = results[case]["logits"]
        assert tp2.shape == hf.shape, f"rank {rank}: logits are not full-vocabulary rows"
        assert (tp2 - tp1).abs().max() < testing.LOGITS_ATOL, f"rank {rank} differs from TP=1"
        assert (tp2 - hf).abs().max() < testing.LOGITS_ATOL, f"rank {rank} differs from transformers"
    assert torch.equal(ranks[0][case]["logits"], ranks[1][case]["logits"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rank_holds_only_its_shard(tp_run, case):
    cases, ranks = tp_run
    config = load_hf_config(cases[case])
    head_dim = getattr(config, "head_dim", None) or HIDDEN // HEADS
    kv_heads = config.num_key_value_heads
    group = HEADS // kv_heads  # query heads per KV head
    with safe_open(str(Path(cases[case]) / "model.safetensors"), "pt") as f:
        q, k, v = (f.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv")
    for rank, results in enumerate(ranks):
        shapes = results[case]["shapes"]
        local_q = list(range(rank * HEADS // WORLD, (rank + 1) * HEADS // WORLD))
        local_kv = sorted({h // group for h in local_q})  # the KV heads those query heads read
        rows = (len(local_q) + 2 * len(local_kv)) * head_dim
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (rows, HIDDEN)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (HIDDEN, HEADS * head_dim // WORLD)
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * INTERMEDIATE // WORLD, HIDDEN)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (HIDDEN, INTERMEDIATE // WORLD)
        assert shapes["model.embed_tokens.weight"] == (-(-config.vocab_size // WORLD), HIDDEN)
        assert ("lm_head.weight" in shapes) != config.tie_word_embeddings
        assert shapes["model.norm.weight"] == (HIDDEN,)

        def heads(weight, ids):
            return torch.cat([weight[h * head_dim:(h + 1) * head_dim] for h in ids])

        expected = torch.cat([heads(q, local_q), heads(k, local_kv), heads(v, local_kv)])
        assert torch.equal(results[case]["qkv"], expected)


def test_dummy_load_format_gives_finite_full_logits(tp_run):
    _, ranks = tp_run
    logits = ranks[0]["dummy"]["logits"]
    assert logits.shape == (sum(map(len, PROMPTS)), 320)
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(logits, ranks[1]["dummy"]["logits"])


@pytest.fixture
def fake_rank(monkeypatch):
    """Make layers built afterwards believe they are ``rank`` of ``size`` (no process group)."""
    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(distributed, "_tp_rank", rank)
        monkeypatch.setattr(distributed, "_tp_size", size)
    return set_rank


def test_weight_loaders_copy_this_ranks_slice_from_lazy_slices(tmp_path, fake_rank):
    """Four ranks, two KV heads (replicated twice), a vocabulary of 10 padded to 12."""
    head_dim, hidden, heads, kv_heads, tp = 2, 8, 8, 2, 4
    full = {
        "q": torch.randn(heads * head_dim, hidden), "k": torch.randn(kv_heads * head_dim, hidden),
        "v": torch.randn(kv_heads * head_dim, hidden), "qkv_bias": torch.randn(heads * head_dim),
        "col": torch.randn(12, hidden), "gate": torch.randn(16, hidden), "up": torch.randn(16, hidden),
        "row": torch.randn(hidden, 16), "row_bias": torch.randn(hidden), "embed": torch.randn(10, hidden),
    }
    save_file(full, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        for rank in range(tp):
            fake_rank(rank, tp)
            qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
            for shard in "qkv":
                qkv.weight_loader(qkv.weight, f.get_slice(shard), shard)
            qkv.weight_loader(qkv.bias, f.get_slice("qkv_bias"), "q")
            kv_rows = slice(rank // 2 * head_dim, (rank // 2 + 1) * head_dim)  # kv head = rank // 2
            q_rows = slice(rank * 2 * head_dim, (rank + 1) * 2 * head_dim)
            assert torch.equal(qkv.weight, torch.cat([full["q"][q_rows], full["k"][kv_rows], full["v"][kv_rows]]))
            assert torch.equal(qkv.bias[:4], full["qkv_bias"][q_rows])

            col = ColumnParallelLinear(hidden, 12)
            col.weight_loader(col.weight, f.get_slice("col"))
            assert torch.equal(col.weight, full["col"][rank * 3:(rank + 1) * 3])

            gate_up = MergedColumnParallelLinear(hidden, {"gate": 16, "up": 16})
            gate_up.weight_loader(gate_up.weight, f.get_slice("gate"), "gate")
            gate_up.weight_loader(gate_up.weight, f.get_slice("up"), "up")
            part = slice(rank * 4, (rank + 1) * 4)
            assert torch.equal(gate_up.weight, torch.cat([full["gate"][part], full["up"][part]]))

            row = RowParallelLinear(16, hidden, bias=True)
            row.weight_loader(row.weight, f.get_slice("row"))
            row.weight_loader(row.bias, f.get_slice("row_bias"))
            assert torch.equal(row.weight, full["row"][:, part])
            assert torch.equal(row.bias, full["row_bias"])

            embed = VocabParallelEmbedding(10, hidden)
            embed.weight_loader(embed.weight, f.get_slice("embed"))
            real = full["embed"][rank * 3:(rank + 1) * 3]
            assert embed.weight.shape == (3, hidden)
            assert torch.equal(embed.weight[:len(real)], real)
            assert not embed.weight[len(real):].any()  # padding rows of the last rank
            assert isinstance(ParallelLMHead(10, hidden), VocabParallelEmbedding)


def test_weight_loader_rejects_a_wrong_checkpoint_shape(fake_rank):
    fake_rank(1, 2)
    layer = ColumnParallelLinear(8, 12)
    with pytest.raises(ValueError, match=r"checkpoint shape \(10, 8\) != expected \(12, 8\)"):
        layer.weight_loader(layer.weight, torch.zeros(10, 8))


class NotOptedIn(nn.Module):
    pass


@pytest.mark.parametrize("model_cls, overrides, tp, gpus, message", [
    (NotOptedIn, {}, 2, None, "NotOptedIn does not support tensor parallelism"),
    (LlamaForCausalLM, dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=96), 4, None,
     "num_attention_heads=6 is not divisible"),
    (LlamaForCausalLM, dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96), 2, None,
     "num_key_value_heads=3 must be divisible"),
    (LlamaForCausalLM, dict(intermediate_size=130), 4, None, "intermediate_size=130 is not divisible"),
    (LlamaForCausalLM, {}, 4, 2, "needs 4 GPUs, only 2 visible"),
    (LlamaForCausalLM, {}, 0, None, "must be >= 1"),
])
def test_check_tensor_parallel_refuses(model_cls, overrides, tp, gpus, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(model_cls, testing.tiny_llama_config(**overrides), tp, num_visible_gpus=gpus)


def test_check_tensor_parallel_accepts():
    check_tensor_parallel(NotOptedIn, testing.tiny_llama_config(), 1)  # one rank: any model
    check_tensor_parallel(LlamaForCausalLM, testing.tiny_llama_config(), 2, num_visible_gpus=2)
    # Fewer KV heads than ranks (replicated) and an odd vocabulary (padded) are fine.
    check_tensor_parallel(LlamaForCausalLM, testing.tiny_llama_config(num_key_value_heads=1, vocab_size=301), 4)


def test_engine_config_validates_tp_fields():
    assert EngineConfig("m", tensor_parallel_size=2, load_format="dummy").tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig("m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig("m", load_format="pt")
