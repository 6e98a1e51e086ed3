"""The transformers modeling backend (``hookllm.adapters.transformers``) against transformers itself.

Each architecture is a tiny random checkpoint (fp32, CPU). hookllm's greedy tokens must equal
transformers' ``generate`` and its prompt logprobs a transformers forward's log-softmax, with
prefill chunked (32-token steps), requests preempted (the bytes of 8 KV blocks for 4 prompts), in both
scheduling modes, and again from the prefix cache. Windowed models get prompts longer than
their window. Then: the fallback and ``model_impl``, the one-line refusals, ``hookllm plugins``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, BertConfig, BloomConfig, CohereConfig, DebertaV2Config, FalconH1Config, Gemma2Config,
    Gemma3TextConfig, GemmaConfig, GPTNeoXConfig, GptOssConfig, GraniteConfig, JambaConfig, LlamaConfig, MambaConfig,
    MixtralConfig, Olmo2Config, OPTConfig, Phi3Config, Qwen3MoeConfig, SmolLM3Config, Starcoder2Config, T5Config,
)

from hookllm import LLM, SamplingParams, testing
from hookllm.config import layer_sliding_windows
from hookllm.adapters.transformers.kernels import FusedGatedMLP, FusedQKVAttention
from hookllm.adapters.transformers.model import TransformersForCausalLM
from hookllm.layers import RMSNorm
from hookllm.entrypoints.cli import main
from hookllm.plugins.contract import contract_violations
from hookllm.plugins.registry import ModelRegistry

VOCAB = 256
MAX_TOKENS = 8
WINDOW = 16  # every windowed model's sliding window; prompts run to 70 tokens
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=0)
ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


@dataclass
class Case:
    config: Callable[[], Any]
    model_impl: str = "auto"


def small(**overrides: Any) -> dict:
    return {**SMALL, **overrides}


CASES = {
    "llama": Case(lambda: LlamaConfig(**small()), model_impl="transformers"),
    "gemma": Case(lambda: GemmaConfig(**small(head_dim=16))),
    "gemma2-softcap-window": Case(lambda: Gemma2Config(**small(head_dim=16, **ALTERNATING, query_pre_attn_scalar=16,
                                                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                                               initializer_range=0.05))),
    "gemma3-text-window": Case(lambda: Gemma3TextConfig(**small(head_dim=16, **ALTERNATING, query_pre_attn_scalar=16,
                                                                initializer_range=0.05))),
    "phi3": Case(lambda: Phi3Config(**small())),
    "olmo2": Case(lambda: Olmo2Config(**small())),
    "granite-scalings": Case(lambda: GraniteConfig(**small(logits_scaling=4.0, embedding_multiplier=2.0,
                                                           residual_multiplier=0.5, attention_multiplier=0.2))),
    "cohere-logit-scale": Case(lambda: CohereConfig(**small(logit_scale=0.5))),
    "starcoder2-window": Case(lambda: Starcoder2Config(**small(sliding_window=WINDOW, initializer_range=0.2))),
    "smollm3-nope-layers": Case(lambda: SmolLM3Config(**small(no_rope_layers=[1, 0]))),
    "gpt-neox-partial-rotary": Case(lambda: GPTNeoXConfig(**small(rotary_pct=0.25))),
    "opt-learned-positions": Case(lambda: OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=64, bos_token_id=0, eos_token_id=1, pad_token_id=0)),
    "qwen3-moe": Case(lambda: Qwen3MoeConfig(**small(head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                     num_experts_per_tok=2)), model_impl="transformers"),
    "mixtral": Case(lambda: MixtralConfig(**small(num_local_experts=4, num_experts_per_tok=2)),
                    model_impl="transformers"),
    "gpt-oss-sinks-window": Case(lambda: GptOssConfig(**small(head_dim=16, **ALTERNATING, num_local_experts=4,
                                                              num_experts_per_tok=2)), model_impl="transformers"),
}


def windowed(config: Any) -> bool:
    return getattr(config, "sliding_window", None) is not None


@dataclass
class Expected:
    """A case's checkpoint and what transformers answers for its prompts."""

    path: Any
    model_impl: str
    windowed: bool
    hybrid: bool  # sliding and full layers: a KV cache group each, whose blocks hold one of the two layers
    prompts: list[list[int]]
    tokens: list[list[int]]  # transformers' greedy continuation of each prompt
    logprobs: list[torch.Tensor]  # log-softmax of a transformers forward over each prompt


def expected_of(config: Any, path: Any, model_impl: str, prompts: list[list[int]]) -> Expected:
    """A tiny random checkpoint of ``config`` saved in ``path``, and transformers' answers for ``prompts``."""
    path = testing.build_tiny_checkpoint(config, path)
    # Eager attention: the one every transformers version computes every variant with (5.17's
    # sdpa path for Gemma 2 drops the attention soft-cap).
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    tokens = [testing.reference_greedy(reference, prompt, MAX_TOKENS) for prompt in prompts]
    assert sum(len(set(t)) > 1 for t in tokens) >= 3, "constant reference outputs prove little"
    with torch.inference_mode():
        logprobs = [reference(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]
    hybrid = len(set(layer_sliding_windows(config))) > 1
    return Expected(path, model_impl, windowed(config), hybrid, prompts, tokens, logprobs)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> Expected:
    spec = CASES[request.param]
    config = spec.config()
    # Longer than the window (16) where there is one; 4 of them overflow 8 KV blocks.
    prompts = testing.random_prompts(4, VOCAB, min_len=20 if not windowed(config) else 40, max_len=70, seed=5)
    return expected_of(config, tmp_path_factory.mktemp(request.param), spec.model_impl, prompts)


def make_llm(expected: Expected, **kwargs: Any) -> LLM:
    kwargs = dict(dtype="float32", device="cpu", model_impl=expected.model_impl, **kwargs)
    return LLM(str(expected.path), **kwargs)


def assert_prompt_logprobs(output: Any, prompt: list[int], expected: torch.Tensor) -> None:
    entries = output.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    got = torch.tensor([entry[token].logprob for entry, token in zip(entries[1:], prompt[1:])])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tokens_and_prompt_logprobs_equal_transformers(case, async_scheduling):
    # 4 prompts overflow 8 blocks of both layers; 16 blocks of one layer each (hybrid) are as many bytes.
    llm = make_llm(case, max_num_batched_tokens=32, num_kv_blocks=16 if case.hybrid else 8,
                   async_scheduling=async_scheduling)
    assert (llm.engine.engine_core.scheduler.block_manager.group_windows == (None, WINDOW)) == case.hybrid
    model = llm.engine.engine_core.executor.model
    assert isinstance(model, TransformersForCausalLM)
    assert any(layer.sliding_window == WINDOW for layer in model.attention) == case.windowed
    assert_answers_as_transformers(llm, case.prompts, case.tokens, case.logprobs)


def assert_answers_as_transformers(llm: LLM, prompts: list[list[int]], tokens: list[list[int]],
                                   logprobs: list[torch.Tensor]) -> None:
    """``llm``'s greedy tokens and prompt logprobs of ``prompts`` equal transformers' (``tokens``,
    ``logprobs``) with some prefill chunked and some request preempted; then the same tokens again
    from the prefix cache, and no KV block held at the end."""
    batches = testing.record_batches(llm.engine)
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tokens
    for output, prompt, expected in zip(outputs, prompts, logprobs):
        assert_prompt_logprobs(output, prompt, expected)
    assert any(len(b.sampling_rows) < len(b.request_ids) for b in batches), "no prefill was chunked"
    assert any(b.preempted_request_ids for b in batches), "no request was preempted"
    # Again, now reading the prompts' KV blocks from the prefix cache (no prompt logprobs: those skip it).
    again = llm.generate(requests, testing.greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == tokens
    assert llm.engine.get_stats().prefix_cache_hits > 0
    testing.assert_all_blocks_free(llm)


def test_llama_through_transformers_equals_the_native_adapter(tmp_path):
    path = testing.build_tiny_checkpoint(LlamaConfig(**small(tie_word_embeddings=True)), tmp_path)
    native = LLM(str(path), dtype="float32", device="cpu", model_impl="native")
    backend = LLM(str(path), dtype="float32", device="cpu", model_impl="transformers")
    assert type(backend.engine.engine_core.executor.model) is TransformersForCausalLM
    assert type(native.engine.engine_core.executor.model).__name__ == "LlamaForCausalLM"
    prompt = testing.random_prompts(1, VOCAB, min_len=30, max_len=30, seed=9)[0]
    torch.testing.assert_close(testing.prompt_logits(backend, prompt), testing.prompt_logits(native, prompt),
                               atol=1e-4, rtol=0)
    prompts = [{"prompt_token_ids": p} for p in testing.random_prompts(3, VOCAB, seed=10)]
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, testing.greedy(MAX_TOKENS), use_tqdm=False)]
              for llm in (native, backend)]
    assert tokens[0] == tokens[1]


def test_model_class_satisfies_the_model_protocol():
    assert contract_violations(TransformersForCausalLM) == []


def test_sharded_checkpoint_with_tied_embeddings_and_a_wrong_tensor(tmp_path):
    """The loader names the first missing and the first unexpected tensor."""
    from safetensors.torch import load_file, save_file

    path = testing.build_tiny_checkpoint(LlamaConfig(**small()), tmp_path / "ok")
    tensors = load_file(str(path / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    tensors["model.layers.0.mlp.extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight; "
                                         r"unexpected tensor model\.layers\.0\.mlp\.extra\.weight"):
        LLM(str(broken), dtype="float32", device="cpu", model_impl="transformers")


def save_config(config: Any, path) -> str:
    """A checkpoint folder holding only ``config.json``: every refusal comes before any weight is read."""
    config.save_pretrained(str(path))
    return str(path)


BERT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
REFUSALS = {
    "mamba": (lambda: MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2), "MambaForCausalLM",
              r"state-space / recurrent layers"),
    "jamba": (lambda: JambaConfig(**small(num_experts=2)), "JambaForCausalLM", r"state-space / recurrent layers"),
    "falcon-h1": (lambda: FalconH1Config(**small(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16)),
                  "FalconH1ForCausalLM", r"state-space / recurrent layers \(hybrid\)"),
    "deberta-encoder": (lambda: DebertaV2Config(**BERT), "DebertaV2Model",
                        r"does not route attention through transformers' attention interface"),
    "bert-decoder": (lambda: BertConfig(**BERT, is_decoder=True), "BertLMHeadModel", r"causal attention in an encoder"),
    "t5": (lambda: T5Config(vocab_size=VOCAB, d_model=64, num_layers=2), "T5ForConditionalGeneration",
           r"encoder-decoder model"),
    "alibi": (lambda: BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4), "BloomForCausalLM",
              r"ALiBi"),
    "chunked-attention": (lambda: LlamaConfig(**small(layer_types=["chunked_attention", "full_attention"])),
                          "LlamaForCausalLM", r"chunked_attention layers, which hookllm's attention kernels lack"),
    "dynamic-rope": (lambda: LlamaConfig(**small(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0})),
                     "LlamaForCausalLM", r"'dynamic' RoPE scaling"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_are_one_line_saying_why(name, tmp_path):
    make_config, architecture, why = REFUSALS[name]
    config = make_config()
    config.architectures = [architecture]
    with pytest.raises(ValueError, match=why) as refusal:
        LLM(save_config(config, tmp_path), dtype="float32", device="cpu", model_impl="transformers")
    assert "\n" not in str(refusal.value)


def test_unknown_architecture_names_the_fallback(tmp_path):
    config = LlamaConfig(**small())
    config.architectures = ["NoSuchModelForCausalLM"]
    with pytest.raises(ValueError, match=r"no installed plugin serves architecture 'NoSuchModelForCausalLM'.*"
                                         r"plugin 'transformers' serves every other causal LM"):
        LLM(save_config(config, tmp_path), dtype="float32", device="cpu")


def test_model_impl_picks_the_implementation(tiny_llama_dir, tmp_path):
    phi = save_config(Phi3Config(**small(architectures=["Phi3ForCausalLM"])), tmp_path)
    with pytest.raises(ValueError, match=r"model_impl='native': no installed plugin implements architecture "
                                         r"'Phi3ForCausalLM' natively; transformers serves it as a fallback"):
        LLM(phi, dtype="float32", device="cpu", model_impl="native")
    with pytest.raises(ValueError, match=r"model_impl must be one of"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", model_impl="vllm")
    from hookllm.engine.arg_utils import EngineArgs
    from hookllm.utils import FlexibleArgumentParser

    argv = ["--model", str(tiny_llama_dir), "--model-impl", "transformers"]
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(argv)
    assert EngineArgs.from_cli_args(args).create_engine_config().model_impl == "transformers"


def test_a_dropped_engine_frees_its_model_though_the_model_holds_reference_cycles(tiny_llama_dir):
    """The engine freezes what exists at its start out of the collector's sight; a model with
    cycles (its decoder bound as a method of itself) must still be freed once the engine goes,
    or each engine built after it in the process finds less GPU memory."""
    import gc
    import weakref

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", model_impl="transformers")
    model = weakref.ref(llm.engine.engine_core.executor.model)
    del llm
    gc.collect()
    assert model() is None


def test_registry_prefers_native_registrations_over_the_fallback():
    registry = ModelRegistry()
    registry.register("LlamaForCausalLM", "native:Llama", plugin="llama")
    registry.register_fallback("backend:Any", lambda arch: arch.endswith("ForCausalLM"), plugin="transformers",
                               description="every causal LM")
    assert registry.owner("LlamaForCausalLM") == "llama"
    assert registry.owner("Phi3ForCausalLM") == "transformers"
    assert registry.owner("LlamaForCausalLM", model_impl="transformers") == "transformers"
    assert registry.owner("LlamaForCausalLM", model_impl="native") == "llama"
    assert registry.explain("LlamaForCausalLM") == "llama (native)"
    assert registry.explain("Phi3ForCausalLM") == "transformers (fallback)"
    with pytest.raises(ValueError, match=r"no installed plugin serves architecture 'BertModel'.*"
                                         r"plugin 'transformers' serves every causal LM"):
        registry.owner("BertModel")
    with pytest.raises(ValueError, match=r"plugin 'transformers' does not claim it"):
        registry.owner("BertModel", model_impl="transformers")
    with pytest.raises(ValueError, match=r"plugin 'gguf' is not an installed fallback plugin"):
        registry.owner("LlamaForCausalLM", model_impl="gguf")


def test_plugins_lists_who_serves_each_architecture(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("transformers (hookllm 0.1.0)"):].splitlines()
    assert block[1].split() == ["hooks:", "register_models"]
    assert block[2].split()[:4] == ["fallback:", "every", "other", "causal"]
    served = out[out.index("served by (--model-impl auto):"):].splitlines()
    assert any(line.split() == ["LlamaForCausalLM", "llama", "(native)"] for line in served)
    assert any(line.split() == ["any", "other", "architecture", "transformers", "(fallback)"] for line in served)
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["transformers"]["fallback"].startswith("every other causal LM")
    assert "fallback" not in rows["llama"]


@pytest.mark.parametrize("name, swapped", [("llama", True), ("gemma", False)])
def test_rms_norms_hookllm_computes_alike_run_on_its_kernel(name, swapped, tmp_path):
    """Llama's RMSNorm modules become hookllm's one-kernel RMSNorm; Gemma's (``1 + weight``)
    computes something else and keeps its own."""
    path = testing.build_tiny_checkpoint(CASES[name].config(), tmp_path / name)
    model = LLM(str(path), dtype="float32", device="cpu", model_impl="transformers").engine.engine_core.executor.model
    norms = [type(m) for m in model.hf_model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all((cls is RMSNorm) == swapped for cls in norms)


@pytest.mark.parametrize("name, head_alone", [("llama", True), ("gemma2-softcap-window", False),
                                              ("cohere-logit-scale", False), ("granite-scalings", False)])
def test_logits_skip_the_causal_lm_forward_only_when_it_adds_nothing_to_the_head(name, head_alone, tmp_path):
    """The CausalLM forward (about a decode step's host time) runs only for a model that changes
    its head's logits: Gemma 2's final soft-cap, Cohere's logit scale, Granite's scaling."""
    path = testing.build_tiny_checkpoint(CASES[name].config(), tmp_path / name)
    model = LLM(str(path), dtype="float32", device="cpu", model_impl="transformers").engine.engine_core.executor.model
    assert model._head_alone == head_alone


DENSE = ["llama", "gemma2-softcap-window", "gemma3-text-window", "phi3", "olmo2", "granite-scalings",
         "cohere-logit-scale", "starcoder2-window", "smollm3-nope-layers", "gpt-neox-partial-rotary",
         "opt-learned-positions"]


def test_compiled_code_is_cached_under_hookllms_cache_root_unless_inductor_is_told_otherwise(tiny_llama_dir, tmp_path,
                                                                                             monkeypatch):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", model_impl="transformers")
    monkeypatch.setenv("HOOKLLM_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    llm.engine.engine_core.executor.model.use_torch_compile(backend="eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "root" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    llm.engine.engine_core.executor.model.use_torch_compile(backend="eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize("name", DENSE)
def test_torch_compile_traces_each_dense_decoder_whole_around_the_attention_operator(name, tmp_path):
    """With CUDA graphs the worker compiles the decoder (``use_torch_compile``); paged attention is
    one opaque operator, so dynamo traces a whole forward without a graph break and computes
    what the eager forward does (traced here with dynamo's eager backend: no C compiler)."""
    from torch._dynamo.utils import counters

    path = testing.build_tiny_checkpoint(CASES[name].config(), tmp_path / name)
    eager = LLM(str(path), dtype="float32", device="cpu", model_impl="transformers")
    compiled = LLM(str(path), dtype="float32", device="cpu", model_impl="transformers")
    compiled.engine.engine_core.executor.model.use_torch_compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    for prompt in testing.random_prompts(2, VOCAB, min_len=3, max_len=40, seed=12):
        torch.testing.assert_close(testing.prompt_logits(compiled, prompt), testing.prompt_logits(eager, prompt),
                                   atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


@pytest.mark.parametrize("name, fused", [("llama", 2), ("gemma", 2), ("gpt-neox-partial-rotary", 0)])
def test_gated_mlps_run_gate_and_up_as_one_matmul(name, fused, tmp_path):
    """Llama's and Gemma's gated MLPs (SiLU, GELU) stack gate and up into one weight; GPT-NeoX's
    MLP has no gate and stays as transformers wrote it. (The tokens are checked in the tests above.)"""
    path = testing.build_tiny_checkpoint(CASES[name].config(), tmp_path / name)
    model = LLM(str(path), dtype="float32", device="cpu", model_impl="transformers").engine.engine_core.executor.model
    assert sum(isinstance(m, FusedGatedMLP) for m in model.hf_model.modules()) == fused


@pytest.mark.parametrize("name, fused", [("llama", 2), ("qwen3-moe", 2), ("gemma2-softcap-window", 2),
                                         ("gemma3-text-window", 2), ("smollm3-nope-layers", 1), ("olmo2", 0),
                                         ("gpt-neox-partial-rotary", 0)])
def test_attention_modules_run_q_k_and_v_as_one_matmul(name, fused, tmp_path):
    """Llama's, Qwen 3's (q/k norms), Gemma 2's (window, soft-cap) and Gemma 3's (RoPE by layer
    type) attention modules stack their q, k and v projections into one weight; SmolLM3's layer
    without RoPE, OLMo 2's (q/k norms over the whole projection) and GPT-NeoX's (one
    query_key_value already) compute otherwise and stay as transformers wrote them. (The tokens
    are checked in the tests above.)"""
    path = testing.build_tiny_checkpoint(CASES[name].config(), tmp_path / name)
    model = LLM(str(path), dtype="float32", device="cpu", model_impl="transformers").engine.engine_core.executor.model
    assert sum(isinstance(m, FusedQKVAttention) for m in model.hf_model.modules()) == fused
