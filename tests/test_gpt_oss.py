"""The native gpt-oss adapter (``hookllm.adapters.gpt_oss``) against transformers.

One tiny random gpt-oss (fp32, CPU): a sliding (16-token window) and a full layer, 4 experts of
which each token takes 2, every bias and attention sink random and nonzero. Its expert weights
are rounded onto the MXFP4 grid by this file's own quantizer, so one set of values exists three
ways: packed MXFP4 blocks and scales (``quant_method: mxfp4``, as the hub ships gpt-oss), the
plain checkpoint of those values, and transformers' dequantization of the MXFP4 one. hookllm's
greedy tokens and prompt logprobs must equal transformers' with prompts past the window,
chunked prefill and preemption; the MXFP4 checkpoint must load to exactly the quantized values;
two ranks (tensor or expert parallel) must answer as one. Then YaRN RoPE against transformers'
init function, and the load errors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from hookllm import LLM, SamplingParams, testing
from hookllm.adapters.gpt_oss.model import GptOssForCausalLM
from hookllm.layers.rotary import RotaryEmbedding, yarn_parameters
from hookllm.plugins.contract import contract_violations
from test_tensor_parallel import assert_same_outputs, run
from test_transformers_backend import ALTERNATING, MAX_TOKENS, VOCAB, WINDOW, assert_answers_as_transformers, small
from test_transformers_tensor_parallel import assert_same_prompt_logprobs

PROMPTS = testing.random_prompts(4, VOCAB, min_len=40, max_len=70, seed=5)  # past the 16-token window
EXPERTS, TOP_K = 4, 2
# The real gpt-oss RoPE (YaRN, factor 32 over 4096 positions): max_position_embeddings keeps its
# default, so transformers finds the two consistent; LLM(max_model_len=...) keeps hookllm small.
MAX_MODEL_LEN = 256


def tiny_config(**overrides: Any) -> GptOssConfig:
    fields = small(head_dim=16, **ALTERNATING, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                   max_position_embeddings=131072, initializer_range=0.2)
    return GptOssConfig(**{**fields, **overrides})


# -- an MXFP4 quantizer of our own ---------------------------------------------------------------
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[experts, rows, cols]`` -> (blocks uint8 ``[E, rows, cols/32, 16]``, scales
    uint8 ``[E, rows, cols/32]``, the values they encode, fp32 ``[E, rows, cols]``).

    Each run of 32 columns shares the smallest power of two that brings its largest magnitude
    within e2m1's 6; each value then rounds to the nearest e2m1 magnitude, its sign kept."""
    experts, rows, cols = weight.shape
    groups = weight.float().reshape(experts, rows, cols // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scale = torch.exp2(exponent.float())[..., None]
    scaled = groups / scale
    magnitude = (scaled.abs()[..., None] - E2M1_GRID).abs().argmin(dim=-1)  # e2m1 code without the sign
    negative = (scaled < 0) & (magnitude > 0)
    codes = (magnitude + 8 * negative).to(torch.uint8)
    values = torch.where(negative, -E2M1_GRID[magnitude], E2M1_GRID[magnitude]) * scale
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the earlier value in the low nibble
    return blocks.contiguous(), (exponent + 127).to(torch.uint8), values.reshape(experts, rows, cols)


@dataclass
class Checkpoints:
    plain: Path  # gpt-oss's bf16 layout, holding the quantized values (fp32)
    mxfp4: Path  # the same experts as MXFP4 blocks and scales
    values: dict[str, torch.Tensor]  # each quantized parameter's values, checkpoint layout ([E, in, out])
    tokens: list[list[int]]  # transformers' greedy continuation of each prompt (plain checkpoint)
    logprobs: list[torch.Tensor]  # log-softmax of a transformers forward over each prompt


def randomize_biases_and_sinks(tensors: dict[str, torch.Tensor], seed: int = 0) -> None:
    """transformers initialises every bias to zero; random ones (and larger sinks) make their
    handling observable: "added once" under tensor parallelism, sinks sliced by heads."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("bias") or name.endswith("sinks"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * (1.0 if name.endswith("sinks") else 0.2)


def save_checkpoint(tensors: dict[str, torch.Tensor], config_json: dict, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_json))
    return path


def edited(source: Path, path: Path, quant_method: str | None = None, drop: tuple[str, ...] = (),
           **tensors: torch.Tensor) -> Path:
    """A copy of checkpoint ``source`` in ``path`` with another ``quant_method``, tensors
    replaced (``tensors``) or removed (``drop``)."""
    weights = {**load_file(str(source / "model.safetensors")), **tensors}
    config_json = json.loads((source / "config.json").read_text())
    if quant_method is not None:
        config_json["quantization_config"]["quant_method"] = quant_method
    return save_checkpoint({n: t for n, t in weights.items() if n not in drop}, config_json, path)


def load_eager(path: Path, **kwargs: Any) -> Any:
    """transformers' model of a checkpoint in fp32 with eager attention (the one that takes sinks)."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                **kwargs).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    root = tmp_path_factory.mktemp("gpt-oss")
    random = testing.build_tiny_checkpoint(tiny_config(), root / "random")
    config_json = json.loads((random / "config.json").read_text())
    tensors = load_file(str(random / "model.safetensors"))
    randomize_biases_and_sinks(tensors)
    quantized, values = dict(tensors), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # The blocks run along each output feature's inputs: the checkpoint's [E, in, out] transposed.
        blocks, scales, encoded = quantize_mxfp4(tensors[name].transpose(1, 2))
        values[name] = tensors[name] = encoded.transpose(1, 2).contiguous()
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    plain = save_checkpoint(tensors, config_json, root / "plain")
    # As the hub's gpt-oss config.json says it (attention, router, embeddings and head stay bf16).
    config_json["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    packed = save_checkpoint(quantized, config_json, root / "mxfp4")
    reference = load_eager(plain)
    tokens = [testing.reference_greedy(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]
    assert sum(len(set(t)) > 1 for t in tokens) >= 3, "constant reference outputs prove little"
    with torch.inference_mode():
        logprobs = [reference(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in PROMPTS]
    return Checkpoints(plain, packed, values, tokens, logprobs)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN, **kwargs}
    return LLM(str(path), **kwargs)


def test_model_class_satisfies_the_model_protocol():
    assert contract_violations(GptOssForCausalLM) == []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tokens_and_prompt_logprobs_equal_transformers(checkpoints, async_scheduling):
    """As the transformers backend's test of the same name: prompts past the window, 32-token
    prefill chunks, and 16 KV blocks per layer kind for four 40-70-token prompts (preemption)."""
    llm = make_llm(checkpoints.plain, max_num_batched_tokens=32, num_kv_blocks=16, async_scheduling=async_scheduling)
    model = llm.engine.engine_core.executor.model
    assert type(model) is GptOssForCausalLM
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [WINDOW, None]
    assert llm.engine.engine_core.scheduler.block_manager.group_windows == (None, WINDOW)
    assert_answers_as_transformers(llm, PROMPTS, checkpoints.tokens, checkpoints.logprobs)


def test_sinks_and_biases_matter(checkpoints, tmp_path):
    """The comparison above would pass with sinks or expert biases ignored if they changed
    nothing: zeroing them must move the logits."""
    tensors = load_file(str(checkpoints.plain / "model.safetensors"))
    config_json = json.loads((checkpoints.plain / "config.json").read_text())
    base = testing.prompt_logits(make_llm(checkpoints.plain), PROMPTS[0])
    for suffix in ("sinks", "experts.gate_up_proj_bias", "experts.down_proj_bias"):
        changed = {n: torch.zeros_like(t) if n.endswith(suffix) else t for n, t in tensors.items()}
        path = save_checkpoint(changed, config_json, tmp_path / suffix)
        assert (testing.prompt_logits(make_llm(path), PROMPTS[0]) - base).abs().max() > 1e-2, suffix


def expert_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """The stacked expert parameters hookllm loaded, by checkpoint name."""
    model = llm.engine.engine_core.executor.model
    return {f"model.layers.{i}.mlp.experts.{name}": getattr(layer.mlp.experts, name).detach()
            for i, layer in enumerate(model.model.layers) for name in ("gate_up_proj", "down_proj")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_checkpoint_loads_exactly_the_quantized_values(checkpoints, dtype):
    llm = make_llm(checkpoints.mxfp4, dtype=str(dtype).removeprefix("torch."))
    loaded = expert_weights(llm)
    inter = tiny_config().intermediate_size
    for name, values in checkpoints.values.items():
        got = loaded[name]
        assert got.dtype == dtype
        # Every MXFP4 value is exact in bf16: nothing may round on the way.
        assert torch.equal(values.to(dtype).float(), values)
        if name.endswith("gate_up_proj"):  # [E, hidden, 2 * inter] interleaved -> [E, gate rows + up rows, hidden]
            want = torch.cat([values[..., 0::2], values[..., 1::2]], dim=-1).transpose(1, 2)
            assert got.shape == (EXPERTS, 2 * inter, values.shape[1])
        else:  # [E, inter, hidden] -> [E, hidden, inter]
            want = values.transpose(1, 2)
        assert torch.equal(got.float(), want), name
    # Everything else loads as from the plain checkpoint.
    plain = dict(make_llm(checkpoints.plain, dtype=str(dtype).removeprefix("torch.")).engine.engine_core.executor
                 .model.named_parameters())
    for name, param in llm.engine.engine_core.executor.model.named_parameters():
        assert torch.equal(param, plain[name]), name


def test_mxfp4_logits_equal_transformers(checkpoints):
    """hookllm on the MXFP4 checkpoint against transformers on the plain one and on the MXFP4
    one dequantized by transformers itself (``Mxfp4Config(dequantize=True)``)."""
    llm = make_llm(checkpoints.mxfp4)
    ours = testing.prompt_logits(llm, PROMPTS[1])
    plain = load_eager(checkpoints.plain)
    theirs = load_eager(checkpoints.mxfp4, quantization_config=Mxfp4Config(dequantize=True))
    for name, values in checkpoints.values.items():
        assert torch.equal(theirs.get_parameter(name).float(), values), name  # the same dequantized values
    with torch.inference_mode():
        for reference in (plain, theirs):
            want = reference(torch.tensor([PROMPTS[1]])).logits[0].float()
            torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], testing.greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == checkpoints.tokens


def test_other_quant_method_is_refused_naming_it(checkpoints, tmp_path):
    path = edited(checkpoints.mxfp4, tmp_path / "gptq", quant_method="gptq")
    with pytest.raises(ValueError, match=r"quant_method 'gptq': no installed plugin provides a quantization method "
                                         r"named 'gptq'; the quantization methods: .*mxfp4"):
        make_llm(path)


def test_wrong_shaped_scales_are_an_error_naming_the_tensor(checkpoints, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_scales"
    scales = load_file(str(checkpoints.mxfp4 / "model.safetensors"))[name]
    path = edited(checkpoints.mxfp4, tmp_path / "bad-scales", **{name: scales[:, :, :1].contiguous()})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales: checkpoint shape "
                                         r"\(4, 64, 1\) != expected \(4, 64, 3\)"):
        make_llm(path)


def test_blocks_without_scales_are_an_error_naming_both(checkpoints, tmp_path):
    path = edited(checkpoints.mxfp4, tmp_path / "lonely", drop=("model.layers.0.mlp.experts.gate_up_proj_scales",))
    experts = r"model\.layers\.0\.mlp\.experts\."
    with pytest.raises(ValueError, match=rf"incomplete MXFP4 tensors: {experts}gate_up_proj_blocks "
                                         rf"\(no {experts}gate_up_proj_scales\)"):
        make_llm(path)


@pytest.mark.parametrize("rope", [
    {},  # gpt-oss's own: factor 32 over 4096 positions, truncate False
    {"truncate": True},
    {"truncate": None},  # no key at all: truncating is the default
    {"factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25},
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 2048},
], ids=["gpt-oss", "truncate", "truncate-by-default", "attention-factor", "mscale"])
def test_yarn_rope_equals_transformers(rope):
    """hookllm's cos/sin table against transformers' yarn init function and gpt-oss's rotary
    module (which applies the attention factor to cos and sin), at positions near and past the
    original context."""
    config = tiny_config(head_dim=64)
    merged = {**config.rope_parameters, **rope}
    config.rope_parameters = {key: value for key, value in merged.items() if value is not None}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = RotaryEmbedding(64, 8192, config.rope_parameters["rope_theta"], config.rope_parameters)
    assert ours.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert attention_factor != 1.0
    positions = torch.tensor([0, 1, 17, 300, 2047, 4095, 8191])
    angles = positions[:, None].float() * inv_freq
    want = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor
    torch.testing.assert_close(ours.cos_sin[positions], want)
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), positions[None])
    torch.testing.assert_close(ours.cos_sin[positions], torch.cat([cos[0], sin[0]], dim=-1))


def test_yarn_blends_frequencies():
    """The gpt-oss settings at head_dim 64 keep the fastest dimensions, slow the slowest 32
    times and blend a band between: all three kinds are present, so the test above checks the ramp."""
    config = tiny_config(head_dim=64)
    base = config.rope_parameters["rope_theta"]
    plain = 1.0 / base ** (torch.arange(0, 64, 2).float() / 64)
    inv_freq, _ = yarn_parameters(plain, 64, base, 131072, config.rope_parameters)
    slowdown = plain / inv_freq
    kept, interpolated = slowdown.isclose(torch.tensor(1.0)), slowdown.isclose(torch.tensor(32.0))
    assert kept[0] and interpolated[-1] and (~kept & ~interpolated).sum() >= 3


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """The spawned ranks share the machine's cores (more threads make gloo's steps crawl)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


TP_PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)


@pytest.fixture(scope="module")
def one_rank(checkpoints) -> list:
    outputs = run(make_llm(checkpoints.plain, num_kv_blocks=64), PROMPTS, TP_PARAMS)
    assert [o.outputs[0].token_ids for o in outputs] == checkpoints.tokens
    return outputs


@pytest.mark.parametrize("checkpoint, expert_parallel", [("plain", False), ("mxfp4", True)],
                         ids=["tensor-parallel-plain", "expert-parallel-mxfp4"])
def test_two_ranks_answer_as_one(checkpoints, one_rank, one_thread_per_rank, checkpoint, expert_parallel):
    """Two gloo ranks (the engine's spawned workers). Tensor parallel splits the heads, their
    sinks and every expert's intermediate dim; expert parallel gives each rank two whole
    experts. From the plain checkpoint each rank reads its part of the stacked tensors (lazy
    slices); from the MXFP4 one each dequantizes every expert, then keeps its part. (Two of the
    four pairings: each spawn of two ranks costs seconds of CI.)"""
    llm = make_llm(getattr(checkpoints, checkpoint), num_kv_blocks=64, tensor_parallel_size=2,
                   enable_expert_parallel=expert_parallel)
    two_ranks = run(llm, PROMPTS, TP_PARAMS)
    assert_same_outputs(one_rank, two_ranks)
    assert_same_prompt_logprobs(one_rank, two_ranks)
