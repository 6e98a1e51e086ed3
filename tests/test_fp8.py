"""FP8 weights and the FP8 KV cache through the engine (the bundled ``fp8`` plugin).

One tiny random Llama (fp32, CPU), quantized by this file's own quantizers into each checkpoint
format the hub uses: Hugging Face's ``fp8`` (block scales, ``weight_scale_inv``) and
compressed-tensors (per-channel with dynamic activations; per-tensor with static input scales
and K/V scales). Each format must load to exactly the quantized values, and its prompt logprobs
must lie within a stated distance of transformers' on the dequantized weights (the only
difference left: the activations' own quantization). ``--quantization fp8`` on the unquantized
checkpoint, and on SmolLM2, is measured against the unquantized model; then the FP8 KV cache, two
ranks, a tiny Qwen3-MoE's FP8 experts (weight-only: exactly the dequantized model), and the errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig

from hookllm import LLM, SamplingParams, testing
from hookllm.kernels.reference import FP8_MAX, FP8_MIN_SCALE
from test_transformers_tensor_parallel import one_thread_per_rank  # noqa: F401 - a fixture

FP8 = torch.float8_e4m3fn
BLOCK = (16, 32)  # rows x columns: unequal, so a swapped axis shows
PROMPTS = testing.random_prompts(3, 320, min_len=20, max_len=40, seed=3)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Mean absolute difference of prompt logprobs (nats) allowed. Against transformers on the
# dequantized weights with the activations quantized as hookllm's kernels do, only fp32 rounding
# differs (an element near a rounding tie may land one e4m3 step apart); against the unquantized
# model, FP8 itself: this random model's large logits make it about 0.2 (SmolLM2's is in
# test_smollm2_quantized_to_fp8_stays_near_fp32).
SIMULATED_TOLERANCE = 2e-3
QUANTIZATION_TOLERANCE = 0.4


# -- this file's quantizers ---------------------------------------------------------------------
def quantize_blocks(weight: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one scale per ``rows x cols`` block (amax / 448), by loops."""
    out, inp = weight.shape
    scales = torch.empty(-(-out // rows), -(-inp // cols))
    q = torch.empty(weight.shape, dtype=FP8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scales[i, j] = block.abs().max() / FP8_MAX
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / scales[i, j]).to(FP8)
    return q, scales


def fake_quantize(x: torch.Tensor, group: int | None, static: float | None = None) -> torch.Tensor:
    """``x`` rounded through e4m3 per token (``group`` None), per token and group of columns, or
    with one static scale, and multiplied back."""
    if static is not None:
        return (x / static).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * static
    rows = x.reshape(-1, x.shape[-1])
    groups = rows.unflatten(1, (-1, group or rows.shape[1]))
    scale = (groups.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return ((groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).reshape(x.shape)


def with_quantized_inputs(model: Any, group: int | None, static: float | None = None) -> Any:
    """transformers' ``model`` with every quantized linear layer's input rounded through e4m3."""
    for name, module in model.named_modules():
        if name.split(".")[-1] in LINEARS:
            module.register_forward_pre_hook(lambda _, args: (fake_quantize(args[0], group, static),))
    return model


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    full = scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:q.shape[0], :q.shape[1]]
    return q.float() * full


def save(tensors: dict[str, torch.Tensor], config_json: dict, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_json))
    return path


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Any]:
    """The unquantized checkpoint, and each quantized format beside the plain checkpoint of its
    dequantized values."""
    root = tmp_path_factory.mktemp("fp8")
    plain = testing.build_tiny_checkpoint(testing.tiny_llama_config(), root / "plain")
    config_json = json.loads((plain / "config.json").read_text())
    tensors = load_file(str(plain / "model.safetensors"))
    made: dict[str, Any] = {"plain": plain, "tensors": tensors}

    def write(name: str, quantization: dict, quantize) -> None:
        packed, values = dict(tensors), dict(tensors)
        for key in filter(is_linear, tensors):
            extra, values[key] = quantize(key, tensors[key])
            packed.update(extra)
        made[name] = save(packed, {**config_json, "quantization_config": quantization}, root / name)
        made[name + "-values"] = save(values, config_json, root / (name + "-values"))
        made[name + "-tensors"] = packed

    def block(key, weight):
        q, scales = quantize_blocks(weight, *BLOCK)
        return {key: q, key + "_scale_inv": scales}, dequantize_blocks(q, scales, *BLOCK)

    write("hf-block", {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
                       "modules_to_not_convert": ["lm_head"]}, block)

    def channel(key, weight):
        q, scales = quantize_blocks(weight, 1, weight.shape[1])
        return {key: q, key + "_scale": scales}, dequantize_blocks(q, scales, 1, weight.shape[1])

    write("ct-channel", compressed_tensors_config(weights="channel", activations={"dynamic": True, "strategy": "token"}),
          channel)

    def tensor(key, weight):
        q, scales = quantize_blocks(weight, *weight.shape)
        prefix = key.removesuffix(".weight")
        static = {key: q, prefix + ".weight_scale": scales.reshape(1), prefix + ".input_scale": torch.tensor([0.02])}
        return static, dequantize_blocks(q, scales, *weight.shape)

    write("ct-tensor-static", compressed_tensors_config(
        weights="tensor", activations={"dynamic": False, "strategy": "tensor"}, kv=True), tensor)
    for layer in range(2):  # the K/V scales of the per-tensor checkpoint
        attention = f"model.layers.{layer}.self_attn"
        made["ct-tensor-static-tensors"][f"{attention}.k_scale"] = torch.tensor(0.05 + layer / 100)
        made["ct-tensor-static-tensors"][f"{attention}.v_scale"] = torch.tensor(0.03)
    save(made["ct-tensor-static-tensors"], json.loads((made["ct-tensor-static"] / "config.json").read_text()),
         made["ct-tensor-static"])
    add_moe_checkpoints(made, root)
    return made


def add_moe_checkpoints(made: dict[str, Any], root: Path) -> None:
    """A tiny Qwen3-MoE (experts' gate/up ``[128, 64]``, down ``[64, 128]``) and its Hugging Face
    ``fp8`` checkpoint with only the experts quantized, in blocks, beside their dequantized values."""
    config = Qwen3MoeConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=128, norm_topk_prob=True, bos_token_id=0, eos_token_id=1)
    plain = made["moe-plain"] = testing.build_tiny_checkpoint(config, root / "moe-plain")
    tensors = made["moe-tensors"] = load_file(str(plain / "model.safetensors"))
    packed, values = dict(tensors), dict(tensors)
    for key in (k for k in tensors if ".experts." in k):
        packed[key], packed[key + "_scale_inv"] = quantize_blocks(tensors[key], *BLOCK)
        values[key] = dequantize_blocks(packed[key], packed[key + "_scale_inv"], *BLOCK)
    config_json = json.loads((plain / "config.json").read_text())
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
                    "modules_to_not_convert": ["lm_head", "self_attn"]}
    made["moe-block"] = save(packed, {**config_json, "quantization_config": quantization}, root / "moe-block")
    made["moe-block-values"] = save(values, config_json, root / "moe-block-values")
    made["moe-block-tensors"] = packed


def compressed_tensors_config(weights: str, activations: dict | None, kv: bool = False) -> dict:
    inputs = None if activations is None else {"num_bits": 8, "type": "float", "symmetric": True, **activations}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"} if kv else None,
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": inputs, "weights": {
                "num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": weights}}}}


def make_llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, **kwargs})


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.engine.engine_core.executor.model


def logprob_distance(llm: LLM, reference: Any) -> float:
    """Mean absolute difference of the prompt logprobs from transformers' ``reference``, every
    position and vocabulary entry."""
    return _distance(llm, lambda prompt: reference(torch.tensor([prompt])).logits[0])


def logprob_distance_between(llm: LLM, other: LLM) -> float:
    """The same between two engines."""
    return _distance(llm, lambda prompt: testing.prompt_logits(other, prompt))


def _distance(llm: LLM, reference_logits: Any) -> float:
    diffs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ours = testing.prompt_logits(llm, prompt).log_softmax(-1)
            theirs = reference_logits(prompt).float().cpu().log_softmax(-1)
            diffs.append((ours - theirs).abs().mean())
    return float(torch.stack(diffs).mean())


# -- checkpoints -----------------------------------------------------------------------------------
def test_block_checkpoint_loads_the_quantized_values_and_expands_block_rows(checkpoints):
    tensors = checkpoints["hf-block-tensors"]
    qkv = model_of(make_llm(checkpoints["hf-block"])).model.layers[0].self_attn.qkv_proj
    parts = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert qkv.weight.dtype == FP8
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([tensors[p] for p in parts]).view(torch.uint8))
    # One scale per row and block of columns: each block row repeated for its 16 rows.
    want = torch.cat([tensors[p + "_scale_inv"].repeat_interleave(BLOCK[0], 0) for p in parts])
    assert torch.equal(qkv.weight_scale_inv, want)


@pytest.mark.parametrize("name, group, static", [("hf-block", BLOCK[1], None), ("ct-channel", None, None),
                                                 ("ct-tensor-static", None, 0.02)])
def test_prompt_logprobs_equal_transformers_on_the_dequantized_weights_and_quantized_inputs(
        checkpoints, name, group, static):
    reference = with_quantized_inputs(testing.load_reference(checkpoints[name + "-values"]), group, static)
    assert logprob_distance(make_llm(checkpoints[name]), reference) < SIMULATED_TOLERANCE


def test_static_checkpoint_reads_kv_scales_for_an_fp8_cache(checkpoints):
    attention = [layer.self_attn.attn for layer in model_of(make_llm(checkpoints["ct-tensor-static"],
                                                                     kv_cache_dtype="fp8")).model.layers]
    assert [(a.k_scale, a.v_scale) for a in attention] == [(pytest.approx(0.05), pytest.approx(0.03)),
                                                          (pytest.approx(0.06), pytest.approx(0.03))]
    # Without an FP8 cache the scales have nothing to scale.
    plain = model_of(make_llm(checkpoints["ct-tensor-static"])).model.layers[0].self_attn.attn
    assert (plain.k_scale, plain.v_scale) == (1.0, 1.0)


def test_quantization_fp8_quantizes_each_output_channel_at_load(checkpoints):
    down = model_of(make_llm(checkpoints["plain"], quantization="fp8")).model.layers[1].mlp.down_proj
    weight = checkpoints["tensors"]["model.layers.1.mlp.down_proj.weight"]
    q, scales = quantize_blocks(weight, 1, weight.shape[1])
    assert torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(down.weight_scale, scales)


def test_quantization_fp8_stays_near_the_unquantized_model(checkpoints):
    reference = testing.load_reference(checkpoints["plain"])
    assert 0 < logprob_distance(make_llm(checkpoints["plain"], quantization="fp8"), reference) < QUANTIZATION_TOLERANCE
    simulated = with_quantized_inputs(testing.load_reference(checkpoints["ct-channel-values"]), None)
    assert logprob_distance(make_llm(checkpoints["plain"], quantization="fp8"), simulated) < SIMULATED_TOLERANCE


def test_fp8_kv_cache_holds_a_block_per_byte_saved_and_stays_near(checkpoints):
    budget = dict(num_kv_blocks=None, cpu_kv_cache_bytes=1 << 20)
    plain, fp8 = make_llm(checkpoints["plain"], **budget), make_llm(checkpoints["plain"], kv_cache_dtype="fp8", **budget)
    worker = fp8.engine.engine_core.executor
    # The same bytes hold four times the blocks of a float32 cache (twice those of a bf16 one).
    assert worker.num_kv_blocks == 4 * plain.engine.engine_core.executor.num_kv_blocks
    assert worker.kv_caches[0][0].dtype == FP8
    # Prompt logprobs read the cache from the second chunk on: prefill in two steps.
    reference = testing.load_reference(checkpoints["plain"])
    assert 0 < logprob_distance(fp8, reference) < QUANTIZATION_TOLERANCE


def test_fp8_kv_cache_survives_swapping_and_prefix_reuse(checkpoints):
    """Greedy tokens with the cache swapped out and back (too few blocks for all requests) equal
    those of a roomy FP8 cache: the blocks' bytes come back as they were."""
    params = testing.greedy(12)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    roomy = make_llm(checkpoints["plain"], kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)
    tight = make_llm(checkpoints["plain"], kv_cache_dtype="fp8", num_kv_blocks=8, preemption_mode="swap",
                     max_model_len=64).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


@pytest.mark.parametrize("name", ["hf-block", "moe-block"])
def test_two_ranks_answer_as_one_from_a_block_checkpoint(checkpoints, one_thread_per_rank, name):
    """Each rank reads its rows (and block rows) of q/k/v and gate/up, and its block columns of
    o and down (and of the experts' alike); per-group activation scales do not depend on the split."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    one = make_llm(checkpoints[name]).generate(prompts, params, use_tqdm=False)
    llm = make_llm(checkpoints[name], tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ours, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-3 for t in ours)


# -- FP8 experts -------------------------------------------------------------------------------------
def test_expert_block_checkpoint_loads_the_quantized_values_and_expands_block_rows(checkpoints):
    experts = model_of(make_llm(checkpoints["moe-block"])).model.layers[1].mlp.experts
    tensors = checkpoints["moe-block-tensors"]
    name = "model.layers.1.mlp.experts.2.{}_proj.weight".format
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8
    gate_up = torch.cat([tensors[name("gate")], tensors[name("up")]])
    assert torch.equal(experts.gate_up_proj[2].view(torch.uint8), gate_up.view(torch.uint8))
    assert torch.equal(experts.down_proj[2].view(torch.uint8), tensors[name("down")].view(torch.uint8))
    scales = torch.cat([tensors[name(p) + "_scale_inv"] for p in ("gate", "up")]).repeat_interleave(BLOCK[0], 0)
    assert torch.equal(experts.gate_up_proj_scale[2], scales)
    assert experts.down_proj_scale.shape == (4, 64, 128 // BLOCK[1])


def test_fp8_experts_compute_transformers_on_the_dequantized_weights(checkpoints):
    """Experts run weight-only: nothing but float32 rounding differs (attention is unquantized)."""
    reference = testing.load_reference(checkpoints["moe-block-values"])
    assert logprob_distance(make_llm(checkpoints["moe-block"]), reference) < 1e-4


def test_quantization_fp8_quantizes_each_experts_rows_at_load(checkpoints):
    llm = make_llm(checkpoints["moe-plain"], quantization="fp8")
    experts = model_of(llm).model.layers[0].mlp.experts
    weight = checkpoints["moe-tensors"]["model.layers.0.mlp.experts.3.down_proj.weight"]
    q, scales = quantize_blocks(weight, 1, weight.shape[1])
    assert torch.equal(experts.down_proj[3].view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(experts.down_proj_scale[3], scales)
    reference = testing.load_reference(checkpoints["moe-plain"])
    assert 0 < logprob_distance(llm, reference) < QUANTIZATION_TOLERANCE


# -- errors -------------------------------------------------------------------------------------------
def edited_config(source: Path, path: Path, **quantization: Any) -> Path:
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **quantization}
    return save(load_file(str(source / "model.safetensors")), config, path)


def test_unknown_quant_method_names_the_served_ones(checkpoints, tmp_path):
    path = edited_config(checkpoints["hf-block"], tmp_path / "awq", quant_method="awq")
    with pytest.raises(ValueError, match=r"quant_method 'awq': no installed plugin provides a quantization method "
                                         r"named 'awq'; the quantization methods: compressed-tensors, fp8"):
        make_llm(path)


def test_int4_compressed_tensors_is_refused_naming_the_bits(checkpoints, tmp_path):
    groups = compressed_tensors_config("channel", None)["config_groups"]
    groups["group_0"]["weights"].update(type="int", num_bits=4)
    path = edited_config(checkpoints["ct-channel"], tmp_path / "int4", config_groups=groups)
    with pytest.raises(ValueError, match=r"weights of type 'int' with 4 bits; the fp8 plugin serves 8-bit float"):
        make_llm(path)


def with_first_scale_column(checkpoints: dict[str, Any], checkpoint: str, name: str, path: Path) -> Path:
    """``checkpoint`` saved again with its scale tensor ``name`` cut to its first column."""
    tensors = checkpoints[checkpoint + "-tensors"]
    return save({**tensors, name: tensors[name][:, :1].contiguous()},
                json.loads((checkpoints[checkpoint] / "config.json").read_text()), path)


def test_wrong_shaped_scale_is_an_error_naming_the_tensor(checkpoints, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    path = with_first_scale_column(checkpoints, "hf-block", name, tmp_path / "bad")
    with pytest.raises(ValueError, match=rf"checkpoint tensor {name}: RowParallelLinear: checkpoint shape "
                                         r"\(4, 1\) != expected \(4, 4\)"):
        make_llm(path)


def test_wrong_shaped_expert_scale_is_an_error_naming_the_tensor(checkpoints, tmp_path):
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"
    path = with_first_scale_column(checkpoints, "moe-block", name, tmp_path / "bad")
    with pytest.raises(ValueError, match=rf"checkpoint tensor {name}: expert down projection's weight scale: "
                                         r"checkpoint shape \(4, 1\) != expected \(4, 4\)"):
        make_llm(path)


def test_quantization_flag_must_match_the_checkpoint(checkpoints):
    with pytest.raises(ValueError, match=r"--quantization fp8 does not match the checkpoint's quant_method "
                                         r"'compressed-tensors'"):
        make_llm(checkpoints["ct-channel"], quantization="fp8")


def test_transformers_backend_refuses_quantization(checkpoints):
    with pytest.raises(ValueError, match=r"quantization 'fp8': LlamaForCausalLM served by 'transformers' has no "
                                         r"quantizable layers"):
        make_llm(checkpoints["plain"], quantization="fp8", model_impl="transformers")
