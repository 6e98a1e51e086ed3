"""Tensor parallelism through the transformers modeling backend (``adapters/transformers/parallel.py``).

Two gloo ranks, the engine's spawned workers, each keep their slice of the weights the model's
transformers plans (``base_model_tp_plan``, and ``base_model_ep_plan`` for experts) split; their greedy tokens, sampled logprobs and
prompt logprobs equal one rank's in fp32. What the backend cannot split is refused before a
weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen3MoeConfig

import tp_helpers
from hookllm import LLM, SamplingParams, testing
from hookllm.adapters.transformers import parallel
from hookllm.adapters.transformers.model import TransformersForCausalLM
from hookllm.adapters.transformers.support import Unsupported
from hookllm.config import load_hf_config
from hookllm.distributed import cleanup_dist_env_and_memory, init_tensor_parallel
from hookllm.worker.model_loader import building_on, load_checkpoint
from hookllm.worker.multiproc_executor import WorkerError
from test_tensor_parallel import assert_same_outputs, run
from test_transformers_backend import CASES, VOCAB, save_config, small

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
PROMPTS = testing.random_prompts(4, VOCAB, min_len=40, max_len=70, seed=5)  # past the windowed cases' 16 tokens


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    """The spawned ranks share the machine's cores (more threads make gloo's steps crawl)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def backend_llm(path: Any, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", model_impl="transformers", num_kv_blocks=64, **kwargs)


def assert_same_prompt_logprobs(tp1: list, tp2: list) -> None:
    for a, b in zip(tp1, tp2):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for ours, theirs in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-4 for t in ours)


def assert_two_ranks_answer_as_one(case: str, path: Any) -> None:
    path = testing.build_tiny_checkpoint(CASES[case].config(), path)
    tp1 = run(backend_llm(path), PROMPTS, PARAMS)
    assert sum(len(set(o.outputs[0].token_ids)) > 1 for o in tp1) >= 3, "constant outputs prove little"
    tp2 = run(backend_llm(path, tensor_parallel_size=2), PROMPTS, PARAMS)
    assert_same_outputs(tp1, tp2)
    assert_same_prompt_logprobs(tp1, tp2)


def test_sliding_window_and_soft_capping_model_split_over_two_ranks_answers_as_one(tmp_path):
    """Gemma 2: q/k/v split by heads, o_proj and the MLP split, on sliding and full layers with
    attention and final-logit soft-capping; the 40-70-token prompts run past the window."""
    assert_two_ranks_answer_as_one("gemma2-softcap-window", tmp_path)


def test_moe_experts_split_over_two_ranks_answer_as_one(tmp_path):
    """Qwen3-MoE under the plan of the installed transformers (the experts' features split, or
    whole experts on each rank; per-expert checkpoint tensors fused at load, then sliced): the
    ranks' partial expert outputs are summed."""
    assert_two_ranks_answer_as_one("qwen3-moe", tmp_path)


ATTENTION_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                  "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                  "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"}
# The two ways transformers has planned stacked experts: (tensor-parallel plan, expert-parallel plan).
MOE_PLANS = {
    # Up to 5.24: each rank keeps a slice of every expert's intermediate features.
    "features": ({**ATTENTION_PLAN, "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                  "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}, None),
    # From 5.25: each rank keeps whole experts, and the tokens routed elsewhere skip them.
    "experts": (ATTENTION_PLAN, {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
                                 "layers.*.mlp.experts.down_proj": "grouped_gemm",
                                 "layers.*.mlp.experts": "ep_dispatch_experts"}),
}
# Qwen3-MoE of hidden 64, 4 heads and 2 KV heads of 16, 4 experts of 32 features, on two ranks.
MOE_SHAPES = {
    "features": {"mlp.experts.gate_up_proj": (4, 32, 64), "mlp.experts.down_proj": (4, 64, 16)},
    "experts": {"mlp.experts.gate_up_proj": (2, 64, 64), "mlp.experts.down_proj": (2, 64, 32)},
}
HAS_EXPERT_PARALLEL_PLANS = hasattr(Qwen3MoeConfig, "base_model_ep_plan")
MOE_PROMPT = [3, 4, 5, 6, 7, 8, 9, 10]


def with_plans(config: Any, plans: str) -> Any:
    config.base_model_tp_plan, config.base_model_ep_plan = MOE_PLANS[plans]
    return config


def planned_rank(rank: int, init_method: str, checkpoint: str, plans: str, out_dir: str) -> None:
    """One of two ranks: build Qwen3-MoE under ``plans`` and load the checkpoint, then save its
    parameters' shapes and the logits of a prompt."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    init_tensor_parallel(rank, 2, "gloo", init_method)
    try:
        with building_on(torch.device("cpu"), torch.float32):
            model = TransformersForCausalLM(with_plans(load_hf_config(checkpoint), plans))
        load_checkpoint(model, checkpoint)
        shapes = {name: tuple(param.shape) for name, param in model.hf_model.named_parameters()}
        torch.save({"shapes": shapes, "logits": tp_helpers.paged_logits(model, [MOE_PROMPT])},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_dist_env_and_memory()



@pytest.mark.parametrize("plans", sorted(MOE_PLANS))
def test_each_rank_holds_only_its_part_of_the_experts_and_computes_transformers_logits(plans, tmp_path):
    """q/k/v keep half their heads, o_proj half its inputs, the experts half their features or
    half the experts; norms, the router, the embedding and the LM head stay whole. Both ranks'
    logits equal those of the whole model run by transformers."""
    if plans == "experts" and not HAS_EXPERT_PARALLEL_PLANS:
        pytest.skip("this transformers' experts code has no 'no expert' id, which expert parallelism needs")
    config = CASES["qwen3-moe"].config()
    config.architectures = ["Qwen3MoeForCausalLM"]
    checkpoint = testing.build_tiny_checkpoint(config, tmp_path / "model")
    tp_helpers.run_ranks(planned_rank, 2, (f"file://{tmp_path}/init", str(checkpoint), plans, str(tmp_path)))
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([MOE_PROMPT])).logits[0]
    shapes_expected = {"self_attn.q_proj.weight": (32, 64), "self_attn.k_proj.weight": (16, 64),
                       "self_attn.v_proj.weight": (16, 64), "self_attn.o_proj.weight": (64, 32),
                       "self_attn.q_norm.weight": (16,), "mlp.gate.weight": (4, 64), **MOE_SHAPES[plans]}
    for rank in (torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)):
        shapes = rank["shapes"]
        assert {name: shapes[f"model.layers.0.{name}"] for name in shapes_expected} == shapes_expected
        assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (VOCAB, 64)
        torch.testing.assert_close(rank["logits"], expected, atol=1e-4, rtol=1e-4)


def dummy_rank(rank: int, init_method: str, config_dir: str, out_dir: str) -> None:
    """One of two ranks: build the model from a config alone, fill it with dummy weights, and
    save the logits of a prompt."""
    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, "gloo", init_method)
    try:
        with building_on(torch.device("cpu"), torch.float32):
            model = TransformersForCausalLM(load_hf_config(config_dir))
        load_checkpoint(model, config_dir, load_format="dummy")
        torch.save(tp_helpers.paged_logits(model, [MOE_PROMPT]), Path(out_dir) / f"rank{rank}.pt")
    finally:
        cleanup_dist_env_and_memory()


def test_dummy_weights_fill_each_ranks_slices_without_reading_a_file(tmp_path):
    """``load_format="dummy"`` on a folder holding a config only: both ranks compute the same
    finite logits."""
    config = CASES["qwen3-moe"].config()
    config.architectures = ["Qwen3MoeForCausalLM"]
    config_dir = save_config(config, tmp_path / "config")
    tp_helpers.run_ranks(dummy_rank, 2, (f"file://{tmp_path}/init", config_dir, str(tmp_path)))
    logits = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert logits[0].shape == (len(MOE_PROMPT), VOCAB) and logits[0].isfinite().all()
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_kv_heads_the_ranks_do_not_divide_are_refused_before_loading(tmp_path):
    """One KV head cannot be split over two ranks, and the backend does not replicate KV heads;
    the folder holds a config only, so the refusal comes before any weight is read."""
    config = LlamaConfig(**small(num_key_value_heads=1), architectures=["LlamaForCausalLM"])
    with pytest.raises(WorkerError, match=r"LlamaForCausalLM: num_key_value_heads=1 is not divisible by "
                                          r"tensor_parallel_size=2; the transformers backend splits attention"):
        backend_llm(save_config(config, tmp_path), tensor_parallel_size=2)


def without_experts_sum() -> Qwen3MoeConfig:
    """Expert parameters split, their partial outputs never summed (transformers 5.17's
    Qwen3-Omni-MoE text plan has this gap)."""
    config = with_plans(CASES["qwen3-moe"].config(), "features")
    config.base_model_tp_plan = {k: v for k, v in config.base_model_tp_plan.items() if v != "moe_tp_experts"}
    return config


def moe(plans: str, **overrides: Any) -> Callable[[], Qwen3MoeConfig]:
    return lambda: with_plans(Qwen3MoeConfig(**small(head_dim=16, **overrides)), plans)


def with_local_params() -> LlamaConfig:
    """A style the backend lacks (MiMo-V2-Flash's plan gives it to its attention, for its sinks)."""
    config = LlamaConfig(**small())
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn": "local_params"}
    return config


PLAN_REFUSALS: dict[str, tuple[Callable[[], Any], str, str]] = {
    "no-plan": (CASES["opt-learned-positions"].config, "OPTForCausalLM",
                r"OPTForCausalLM: its transformers config has no tensor-parallel plan \(base_model_tp_plan\)"),
    "plan-splits-nothing": (lambda: Phi3Config(**small()), "Phi3ForCausalLM",
                            r"Phi3ForCausalLM: its tensor-parallel plan splits no weight "
                            r"\(colwise_gather_output, rowwise_split_input\)"),
    "style-it-lacks": (with_local_params, "LlamaForCausalLM",
                       r"LlamaForCausalLM: its tensor-parallel plan gives layers\.0\.self_attn the style "
                       r"'local_params', which the transformers backend cannot apply"),
    "experts-not-summed": (without_experts_sum, "Qwen3MoeForCausalLM",
                           r"its tensor-parallel plan splits layers\.0\.mlp\.experts\.gate_up_proj but does not "
                           r"sum the output of layers\.0\.mlp\.experts over the ranks"),
    "expert-features": (moe("features", moe_intermediate_size=33, num_experts=4), "Qwen3MoeForCausalLM",
                        r"layers\.0\.mlp\.experts\.gate_up_proj has 33 features along dim 1 in each of its 2 "
                        r"packed blocks, which do not split evenly over 2 ranks"),
    "expert-count": (moe("experts", num_experts=3), "Qwen3MoeForCausalLM",
                     r"layers\.0\.mlp\.experts\.(gate_up|down)_proj has 3 experts, which do not split evenly "
                     r"over 2 ranks"),
}


@pytest.mark.parametrize("name", sorted(PLAN_REFUSALS))
def test_plans_the_backend_cannot_apply_are_refused_saying_why(name, monkeypatch):
    """Built in this process as rank 0 of two: each refusal comes before any collective."""
    make_config, architecture, why = PLAN_REFUSALS[name]
    config = make_config()
    config.architectures = [architecture]
    monkeypatch.setattr(parallel, "get_tp_size", lambda: 2)
    with building_on(torch.device("cpu"), torch.float32), pytest.raises(Unsupported, match=why) as refusal:
        TransformersForCausalLM(config)
    assert "\n" not in str(refusal.value)
