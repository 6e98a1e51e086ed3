"""The example plugin packages, pip-installed the way users install them, seen through the CLI and API."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GPT2Config

from hookllm import LLM, EngineConfig, LLMEngine, SamplingParams, testing
from hookllm.entrypoints.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PACKAGES = ("hookllm-gpt2", "hookllm-logit-bias")
PROMPT = [5, 17, 42, 8, 60, 33]
VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def installed_examples(tmp_path_factory):
    """``pip install`` the example packages (non-editable, from copies: the build leaves files behind)."""
    folder = tmp_path_factory.mktemp("examples")
    paths = [str(shutil.copytree(EXAMPLES / name, folder / name)) for name in PACKAGES]
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation", *paths], check=True)
    importlib.invalidate_caches()
    yield
    subprocess.run(pip + ["uninstall", "-y", *PACKAGES], check=True)
    for module in ("hookllm_gpt2", "hookllm_gpt2.model", "hookllm_logit_bias"):
        sys.modules.pop(module, None)


@pytest.fixture(autouse=True)
def all_plugins(monkeypatch):
    monkeypatch.delenv("HOOKLLM_PLUGINS", raising=False)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A tiny random GPT-2 with a word-level tokenizer (``w0`` ... ``w95``) built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128,
                        bos_token_id=None, eos_token_id=None)
    path = testing.build_tiny_checkpoint(config, tmp_path_factory.mktemp("gpt2"))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(gpt2_dir):
    return testing.load_reference(gpt2_dir)


def cpu_llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, **kwargs)


def greedy_tokens(llm: LLM, params: SamplingParams) -> list[int]:
    return llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids


def test_plugins_lists_packages_with_version_hooks_and_architectures(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"gpt2 \(hookllm-gpt2 0\.1\.0\)\n  hooks: +register_models\n  architectures: +GPT2LMHeadModel\n", out)
    assert re.search(r"logit-bias \(hookllm-logit-bias 0\.1\.0\)\n  hooks: +add_cli_options, add_routes, "
                     r"claim_request_parameters,\s+process_logits\n", out)


def test_plugins_json_lists_packages_with_version_hooks_and_architectures(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    nothing_registered = {"architectures": [], "tool_parsers": [], "reasoning_parsers": [],
                          "quantization_methods": [], "structured_output_backends": []}
    assert rows["gpt2"] == {"name": "gpt2", "distribution": "hookllm-gpt2", "version": "0.1.0",
                            "hooks": ["register_models"], **nothing_registered,
                            "architectures": ["GPT2LMHeadModel"], "error": None}
    assert rows["logit-bias"] == {"name": "logit-bias", "distribution": "hookllm-logit-bias", "version": "0.1.0",
                                  "hooks": ["add_cli_options", "add_routes", "claim_request_parameters", "process_logits"],
                                  **nothing_registered, "error": None}
    assert rows["structured"] == {"name": "structured", "distribution": "hookllm", "version": "0.1.0",
                                  "hooks": ["claim_request_parameters", "preprocess_request",
                                            "register_structured_output_backends", "request_finished",
                                            "start_logits_job", "worker_shutdown"],
                                  **nothing_registered, "structured_output_backends": ["llguidance"], "error": None}


def test_gpt2_adapter_matches_transformers(gpt2_dir):
    testing.assert_adapter_matches_transformers(gpt2_dir, plugins=["gpt2"])


def rewrite_checkpoint(source: Path, target: Path, edit) -> Path:
    """Copy a checkpoint folder with its tensors passed through ``edit(dict) -> dict``."""
    shutil.copytree(source, target)
    save_file(edit(load_file(target / "model.safetensors")), target / "model.safetensors")
    return target


def test_gpt2_loads_old_checkpoints_with_bare_names_and_mask_buffers(gpt2_dir, reference, tmp_path):
    def old_style(tensors):
        tensors = {name.removeprefix("transformer."): t for name, t in tensors.items()}
        mask = torch.tril(torch.ones(128, 128))[None, None]
        return {**tensors, "h.0.attn.bias": mask, "h.0.attn.masked_bias": torch.tensor(-1e4)}

    old = rewrite_checkpoint(gpt2_dir, tmp_path / "old", old_style)
    testing.assert_greedy_matches(cpu_llm(old), reference, testing.random_prompts(2, VOCAB), max_tokens=8)


def test_gpt2_checkpoint_missing_a_tensor_is_an_error_naming_it(gpt2_dir, tmp_path):
    def drop_ln_f(tensors):
        return {name: t for name, t in tensors.items() if name != "transformer.ln_f.bias"}

    broken = rewrite_checkpoint(gpt2_dir, tmp_path / "broken", drop_ln_f)
    with pytest.raises(ValueError, match=r"missing tensors: transformer\.ln_f\.bias"):
        cpu_llm(broken)


def test_gpt2_checkpoint_activates_its_adapter_without_selection(gpt2_dir):
    assert cpu_llm(gpt2_dir).engine.active_plugins == ["core", "gpt2"]


def test_cli_generate_with_gpt2_plugin_prints_transformers_greedy_text(gpt2_dir, reference, capsys):
    tokenizer = AutoTokenizer.from_pretrained(str(gpt2_dir))
    prompt = "w5 w17 w42 w8"
    expected = testing.reference_greedy(reference, tokenizer(prompt)["input_ids"], 8)
    assert len(set(expected)) > 1
    argv = ["generate", "--plugin", "gpt2", "--model", str(gpt2_dir), "--no-chat", "--device", "cpu",
            "--max-tokens", "8", prompt]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected)


def test_cli_flag_added_by_a_plugin_reaches_its_hook(gpt2_dir, reference, capsys):
    tokenizer = AutoTokenizer.from_pretrained(str(gpt2_dir))
    prompt = "w5 w17 w42 w8"
    ids = tokenizer(prompt)["input_ids"]
    first = testing.reference_greedy(reference, ids, 1)[0]
    with torch.inference_mode():
        runner_up = reference(torch.tensor([ids])).logits[0, -1].topk(2).indices[1].item()
    argv = ["generate", "--plugin", "logit-bias", "--ban", str(first), "--model", str(gpt2_dir), "--no-chat",
            "--device", "cpu", "--max-tokens", "1", prompt]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == tokenizer.decode([runner_up])


def test_logit_bias_forces_a_token_when_the_plugin_is_selected(gpt2_dir):
    llm = cpu_llm(gpt2_dir, plugins=["logit-bias"])
    params = SamplingParams(max_tokens=6, temperature=0.0, extra_args={"logit_bias": {7: 100.0}})
    assert greedy_tokens(llm, params) == [7] * 6


def test_banned_token_gives_the_runner_up_token(gpt2_dir, reference):
    with torch.inference_mode():
        top2 = reference(torch.tensor([PROMPT])).logits[0, -1].topk(2).indices.tolist()
    llm = cpu_llm(gpt2_dir, plugins=["logit-bias"])
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"banned_token_ids": [top2[0]]})
    assert greedy_tokens(llm, params) == [top2[1]]


def test_logit_bias_changes_nothing_unless_asked(gpt2_dir, reference):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = cpu_llm(gpt2_dir, plugins=["logit-bias"])
    assert greedy_tokens(llm, params) == testing.reference_greedy(reference, PROMPT, 8)


@pytest.mark.parametrize("extra_args", [{"logit_bias": {7: 100.0}}, {"banned_token_ids": [1, 2, 3]}],
                         ids=["claimed-key", "flag-dest"])
def test_logit_bias_arguments_without_the_plugin_selected_are_refused_naming_it(gpt2_dir, extra_args):
    key = next(iter(extra_args))
    with pytest.raises(ValueError, match=rf"extra_args key '{key}' .*select one with --plugin logit-bias"):
        cpu_llm(gpt2_dir).generate({"prompt_token_ids": PROMPT}, SamplingParams(extra_args=extra_args))


def engine_plugins_and_tokens(config: EngineConfig) -> tuple[list[str], list[int]]:
    """Build an engine from ``config`` alone (as a worker process does) and run one greedy request."""
    engine = LLMEngine(config)
    engine.add_request("0", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, extra_args={"banned_token_ids": [7]}))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    return engine.active_plugins, outputs[0].outputs[0].token_ids


def test_spawned_process_rebuilds_the_same_plugins_from_the_engine_config(gpt2_dir):
    config = EngineConfig(str(gpt2_dir), plugins=["logit-bias"], device="cpu", dtype="float32", num_kv_blocks=16)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(engine_plugins_and_tokens, (config,))
    parent = engine_plugins_and_tokens(config)
    assert parent == child
    assert parent[0] == ["core", "logit-bias", "gpt2"] and 7 not in parent[1]


def test_logit_bias_route_is_served_when_the_plugin_is_active_only(gpt2_dir):
    import asyncio

    import httpx

    from hookllm.engine.async_llm import AsyncLLM
    from hookllm.server.app import ServerSettings, build_app

    async def get(plugins: list[str]) -> httpx.Response:
        config = EngineConfig(str(gpt2_dir), plugins=plugins, device="cpu", dtype="float32", num_kv_blocks=16)
        engine = AsyncLLM.from_engine_config(config)
        try:
            app = build_app(engine, ServerSettings(served_model_names=["gpt2"]))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
                return await http.get("/v1/logit-bias/token-ids", params={"text": "w5 w17"})
        finally:
            engine.shutdown()

    assert asyncio.run(get(["logit-bias"])).json() == {"text": "w5 w17", "token_ids": [5, 17]}
    assert asyncio.run(get([])).status_code == 404
