"""The native mixture-of-experts adapters (``hookllm.adapters.moe``) against transformers.

Tiny random checkpoints (fp32, CPU) of Qwen3-MoE, Qwen3-MoE with dense layers
(``decoder_sparse_step``, ``mlp_only_layers``), Qwen2-MoE with its shared expert and Mixtral with
a sliding window. The engine picks the native class for each; its greedy tokens and prompt
logprobs equal transformers' (eager attention) with prefill chunked and requests preempted, in
both scheduling modes, as tests/test_transformers_backend.py checks the transformers backend.
Then: both checkpoint layouts load, a missing expert tensor is named, and two gloo ranks, tensor
or expert parallel, answer as one, each holding its share of the experts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

import test_transformers_backend as backend
import tp_helpers
from hookllm import LLM, SamplingParams, testing
from hookllm.adapters.moe import ARCHITECTURES
from hookllm.adapters.moe import model as moe
from hookllm.config import load_hf_config
from hookllm.distributed import cleanup_dist_env_and_memory, init_tensor_parallel, set_expert_parallel
from hookllm.layers import Attention
from hookllm.plugins.contract import contract_violations
from hookllm.plugins.manager import PluginManager
from hookllm.worker.model_loader import building_on, load_checkpoint
from test_tensor_parallel import assert_same_outputs, run
from test_transformers_tensor_parallel import assert_same_prompt_logprobs

VOCAB, WINDOW, MAX_TOKENS = backend.VOCAB, backend.WINDOW, backend.MAX_TOKENS
EXPERTS = dict(moe_intermediate_size=32, num_experts_per_tok=2)

CASES: dict[str, Callable[[], Any]] = {
    "qwen3-moe": lambda: Qwen3MoeConfig(**backend.small(head_dim=16, num_experts=8, norm_topk_prob=True, **EXPERTS)),
    # Of 4 layers, step 2 makes the 2nd and 4th sparse; mlp_only_layers turns the 4th dense again.
    "qwen3-moe-dense-layers": lambda: Qwen3MoeConfig(**backend.small(
        head_dim=16, num_hidden_layers=4, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3], **EXPERTS)),
    # Not renormalised (Qwen2-MoE's default); qkv bias; the shared expert of 48 features.
    "qwen2-moe-shared-expert": lambda: Qwen2MoeConfig(**backend.small(
        num_experts=4, shared_expert_intermediate_size=48, **EXPERTS)),
    "mixtral-window": lambda: MixtralConfig(**backend.small(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=WINDOW)),
}
SPARSE_LAYERS = {"qwen3-moe-dense-layers": [False, True, False, False]}
WINDOWED = {"mixtral-window"}  # (Qwen2-MoE's config sets sliding_window 0 when it does not slide)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, backend.Expected]:
    """Every case's checkpoint and transformers' answers, built once for all the tests here."""
    expected = {}
    for name, make in CASES.items():
        config = make()
        # Past the window (16) where there is one; 4 of them overflow 8 KV blocks.
        prompts = testing.random_prompts(4, VOCAB, min_len=40 if name in WINDOWED else 20, max_len=70, seed=5)
        expected[name] = backend.expected_of(config, tmp_path_factory.mktemp(name), "auto", prompts)
    return expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tokens_and_prompt_logprobs_equal_transformers(cases, name, async_scheduling):
    case = cases[name]
    llm = backend.make_llm(case, max_num_batched_tokens=32, num_kv_blocks=8, async_scheduling=async_scheduling)
    model = llm.engine.engine_core.executor.model
    architecture = load_hf_config(case.path).architectures[0]
    assert type(model) is getattr(moe, architecture)  # the native class, not the transformers backend
    assert model.supports_tensor_parallel and model.supports_expert_parallel
    sparse = [isinstance(layer.mlp, moe.SparseMoeBlock) for layer in model.model.layers]
    assert sparse == SPARSE_LAYERS.get(name, [True] * len(sparse))
    assert any(m.sliding_window == WINDOW for m in model.modules() if isinstance(m, Attention)) == (name in WINDOWED)
    backend.assert_answers_as_transformers(llm, case.prompts, case.tokens, case.logprobs)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_class_is_registered_and_satisfies_the_model_protocol(architecture):
    model_cls = PluginManager().registry.resolve(architecture)
    assert model_cls is getattr(moe, architecture) and contract_violations(model_cls) == []


def copy_checkpoint(source: Path, target: Path, tensors: dict[str, torch.Tensor]) -> str:
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    save_file(tensors, str(target / "model.safetensors"))
    return str(target)


def stack_experts(tensors: dict[str, torch.Tensor], moe_prefix: str, projections: tuple[str, str, str],
                  num_experts: int) -> dict[str, torch.Tensor]:
    """The per-expert tensors of each layer as transformers 5 holds them: ``experts.gate_up_proj``
    ``[experts, 2 * inter, hidden]`` (gate rows, then up rows) and ``experts.down_proj``."""
    gate, up, down = projections
    out = {n: t for n, t in tensors.items() if ".experts." not in n}
    for layer in sorted({n.split(".")[2] for n in tensors if ".experts." in n}):
        experts = f"model.layers.{layer}.{moe_prefix}.experts"
        proj = lambda e, p: tensors[f"{experts}.{e}.{p}.weight"]  # noqa: E731
        out[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([proj(e, gate), proj(e, up)]) for e in range(num_experts)])
        out[f"{experts}.down_proj"] = torch.stack([proj(e, down) for e in range(num_experts)])
    return out


LAYOUTS = {"qwen3-moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), 8),
           "mixtral-window": ("block_sparse_moe", ("w1", "w3", "w2"), 4)}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_stacked_expert_tensors_load_as_the_per_expert_ones(cases, name, tmp_path):
    path = Path(cases[name].path)
    prefix, projections, num_experts = LAYOUTS[name]
    tensors = stack_experts(load_file(str(path / "model.safetensors")), prefix, projections, num_experts)
    stacked = copy_checkpoint(path, tmp_path / "stacked", tensors)
    prompt = cases[name].prompts[0]
    per_expert = testing.prompt_logits(LLM(str(path), dtype="float32", device="cpu"), prompt)
    torch.testing.assert_close(testing.prompt_logits(LLM(stacked, dtype="float32", device="cpu"), prompt),
                               per_expert, atol=0, rtol=0)


@pytest.mark.parametrize("name, removed, named", [
    ("qwen3-moe", "model.layers.1.mlp.experts.2.up_proj.weight",
     r"model\.layers\.1\.mlp\.experts\.gate_up_proj \[up:2\]"),
    ("mixtral-window", "model.layers.0.block_sparse_moe.experts.3.w2.weight",
     r"model\.layers\.0\.mlp\.experts\.down_proj \[down:3\]"),
])
def test_a_missing_expert_tensor_is_named(cases, name, removed, named, tmp_path):
    path = Path(cases[name].path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[removed]
    broken = copy_checkpoint(path, tmp_path / "broken", tensors)
    with pytest.raises(ValueError, match=rf"missing tensors: {named}$"):
        LLM(broken, dtype="float32", device="cpu")


# -- two ranks ------------------------------------------------------------------------------
PARALLEL_PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2,
                                 prompt_logprobs=1)


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """The spawned ranks share the machine's cores (more threads make gloo's steps crawl)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.usefixtures("one_thread_per_rank")
@pytest.mark.parametrize("name", ["qwen2-moe-shared-expert", "mixtral-window"])
def test_tensor_and_expert_parallel_ranks_answer_as_one(cases, name):
    """TP=2 splits every expert's features (and the shared expert's) over the ranks; EP=2 gives
    each rank half the experts whole. Both sum their shares in one all-reduce per MoE layer."""
    case = cases[name]
    make = lambda **kw: LLM(str(case.path), device="cpu", dtype="float32", num_kv_blocks=64, **kw)  # noqa: E731
    tp1 = run(make(), case.prompts, PARALLEL_PARAMS)
    assert [o.outputs[0].token_ids for o in tp1] == case.tokens
    for parallel in (dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        split = run(make(**parallel), case.prompts, PARALLEL_PARAMS)
        assert_same_outputs(tp1, split)
        assert_same_prompt_logprobs(tp1, split)


def expert_shards_rank(rank: int, init_method: str, path: str, out_dir: str) -> None:
    """One of two ranks: build and load Qwen2-MoE tensor parallel, then expert parallel, and
    save layer 0's stacked experts of each."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    init_tensor_parallel(rank, 2, "gloo", init_method)
    try:
        shards = {}
        for expert_parallel in (False, True):
            set_expert_parallel(expert_parallel)
            with building_on(torch.device("cpu"), torch.float32):
                model = moe.Qwen2MoeForCausalLM(load_hf_config(path))
            load_checkpoint(model, path)
            experts = model.model.layers[0].mlp.experts
            shards[expert_parallel] = (experts.first_expert, experts.gate_up_proj.clone(), experts.down_proj.clone())
        torch.save(shards, Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_dist_env_and_memory()


def test_each_rank_holds_its_share_of_the_experts(cases, tmp_path):
    """Qwen2-MoE's 4 experts of 32 features on two ranks: tensor parallel, each rank holds all 4
    with its 16 features; expert parallel, rank r holds experts 2r and 2r+1 with all 32."""
    path = cases["qwen2-moe-shared-expert"].path
    tp_helpers.run_ranks(expert_shards_rank, 2, (f"file://{tmp_path}/init", str(path), str(tmp_path)))
    tensors = load_file(str(Path(path) / "model.safetensors"))
    weight = lambda e, proj: tensors[f"model.layers.0.mlp.experts.{e}.{proj}.weight"]  # noqa: E731
    for rank in range(2):
        shards = torch.load(tmp_path / f"rank{rank}.pt")
        first, gate_up, down = shards[False]
        features = slice(16 * rank, 16 * (rank + 1))
        assert first == 0 and gate_up.shape == (4, 32, 64) and down.shape == (4, 64, 16)
        for e in range(4):
            torch.testing.assert_close(gate_up[e], torch.cat([weight(e, "gate_proj")[features],
                                                              weight(e, "up_proj")[features]]), atol=0, rtol=0)
            torch.testing.assert_close(down[e], weight(e, "down_proj")[:, features], atol=0, rtol=0)
        first, gate_up, down = shards[True]
        assert first == 2 * rank and gate_up.shape == (2, 64, 64) and down.shape == (2, 64, 32)
        for local in range(2):
            e = first + local
            torch.testing.assert_close(gate_up[local], torch.cat([weight(e, "gate_proj"), weight(e, "up_proj")]),
                                       atol=0, rtol=0)
            torch.testing.assert_close(down[local], weight(e, "down_proj"), atol=0, rtol=0)


def test_expert_parallel_is_refused_for_a_model_without_experts(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"enable_expert_parallel: LlamaForCausalLM served by 'llama' has no "
                                         r"expert-parallel MoE layers"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", enable_expert_parallel=True)


def test_enable_expert_parallel_is_an_engine_flag():
    from hookllm.engine.arg_utils import EngineArgs
    from hookllm.utils import FlexibleArgumentParser

    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--enable-expert-parallel"])
    assert EngineArgs.from_cli_args(args).create_engine_config().enable_expert_parallel is True
