"""The example plugin packages, pip-installed the way users install them, seen through the CLI and API."""

from __future__ import annotations

import json
import multiprocessing
import os
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
PACKAGES = ("hookllm-gpt2", "hookllm-no-repeat-ngram")
PROMPT = [5, 17, 42, 8, 60, 33]
VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def installed_examples(tmp_path_factory):
    """``pip install`` the example packages (non-editable, from copies: the build leaves files behind)
    into a site folder of this module's own, on this process's path and its children's: tests
    running at the same time in other processes (pytest-xdist) never see them."""
    folder = tmp_path_factory.mktemp("examples")
    paths = [str(shutil.copytree(EXAMPLES / name, folder / name)) for name in PACKAGES]
    site = folder / "site"
    subprocess.run([sys.executable, "-m", "pip", "-q", "install", "--no-deps", "--no-build-isolation",
                    "--target", str(site), *paths], check=True)
    with pytest.MonkeyPatch.context() as env:
        env.syspath_prepend(str(site))
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        yield
    for module in ("hookllm_gpt2", "hookllm_gpt2.model", "hookllm_no_repeat_ngram"):
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


def reference_no_repeat_greedy(reference, prompt: list[int], max_tokens: int, size: int) -> list[int]:
    """transformers' greedy continuation under its own ``no_repeat_ngram_size``."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 no_repeat_ngram_size=size)
    return out[0, len(prompt):].tolist()


def has_repeated_ngram(tokens: list[int], size: int) -> bool:
    ngrams = [tuple(tokens[i:i + size]) for i in range(len(tokens) - size + 1)]
    return len(set(ngrams)) < len(ngrams)


def test_plugins_lists_packages_with_version_hooks_and_architectures(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"gpt2 \(hookllm-gpt2 0\.1\.0\)\n  hooks: +register_models\n  architectures: +GPT2LMHeadModel\n", out)
    assert re.search(r"no-repeat-ngram \(hookllm-no-repeat-ngram 0\.1\.0\)\n  hooks: +add_cli_options, add_routes, "
                     r"process_logits\n", out)


def test_plugins_json_lists_packages_with_version_hooks_and_architectures(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    nothing_registered = {"architectures": [], "tool_parsers": [], "reasoning_parsers": [],
                          "quantization_methods": [], "structured_output_backends": [], "poolers": [],
                          "spec_proposers": []}
    assert rows["gpt2"] == {"name": "gpt2", "distribution": "hookllm-gpt2", "version": "0.1.0",
                            "hooks": ["register_models"], **nothing_registered,
                            "architectures": ["GPT2LMHeadModel"], "error": None}
    assert rows["no-repeat-ngram"] == {"name": "no-repeat-ngram", "distribution": "hookllm-no-repeat-ngram",
                                       "version": "0.1.0", "hooks": ["add_cli_options", "add_routes", "process_logits"],
                                       **nothing_registered, "error": None}
    assert rows["structured"] == {"name": "structured", "distribution": "hookllm", "version": "0.1.0",
                                  "hooks": ["claim_request_parameters", "preprocess_request", "register_components",
                                            "start_logits_job", "worker_request_finished", "worker_shutdown"],
                                  **nothing_registered, "structured_output_backends": ["llguidance"], "error": None}


def test_plugins_md_shows_the_no_repeat_ngram_module_as_written():
    import hookllm_no_repeat_ngram

    docs = (EXAMPLES.parent / "docs" / "plugins.md").read_text()
    shown = docs[docs.index("## A plugin in 40 lines"):].split("```python\n", 1)[1].split("```", 1)[0]
    assert shown in Path(hookllm_no_repeat_ngram.__file__).read_text()


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
    expected = reference_no_repeat_greedy(reference, ids, 8, size=2)
    assert expected != testing.reference_greedy(reference, ids, 8)  # the flag changes the answer
    argv = ["generate", "--plugin", "no-repeat-ngram", "--no-repeat-ngram-size", "2", "--model", str(gpt2_dir),
            "--no-chat", "--device", "cpu", "--max-tokens", "8", prompt]
    assert main(argv) == 0
    # The command prints text without special tokens (w0, the unknown token, is one).
    assert capsys.readouterr().out.strip() == tokenizer.decode(expected, skip_special_tokens=True)


def test_banned_tokens_equal_transformers_no_repeat_ngram_processor_row_by_row():
    from hookllm_no_repeat_ngram import banned_tokens
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    generator = torch.Generator().manual_seed(0)
    # Few distinct tokens, so n-grams repeat; lengths around the sizes, so short rows are covered.
    histories = [torch.randint(0, 4, (length,), generator=generator).tolist() for length in (1, 2, 3, 9, 17, 30)] * 2
    sizes = [1, 2, 3, 2, 3, 4, 0, 3, 2, 1, 5, 0]
    banned = banned_tokens(histories, sizes, vocab_size=6)
    for row, (history, size) in enumerate(zip(histories, sizes)):
        scores = torch.zeros(1, 6)
        if size:
            scores = NoRepeatNGramLogitsProcessor(size)(torch.tensor([history]), scores)
        assert banned[row].tolist() == torch.isinf(scores[0]).tolist(), (history, size)


def test_greedy_tokens_equal_transformers_generate_with_no_repeat_ngram_size(gpt2_dir, reference):
    llm = cpu_llm(gpt2_dir, plugins=["no-repeat-ngram"])
    prompts = [PROMPT, PROMPT[:2], [3, 3, 3, 3]]
    for size in (1, 2, 3):
        params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                 extra_args={"no_repeat_ngram_size": size}) for _ in prompts]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outputs] == [
            reference_no_repeat_greedy(reference, p, 12, size) for p in prompts]


def test_rows_of_one_batch_keep_their_own_sizes(gpt2_dir, reference):
    llm = cpu_llm(gpt2_dir, plugins=["no-repeat-ngram"])
    sizes = [0, 2, 3]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, extra_args={"no_repeat_ngram_size": n})
              for n in sizes]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(sizes), params)
    assert outputs[0].outputs[0].token_ids == testing.reference_greedy(reference, PROMPT, 12)
    assert [o.outputs[0].token_ids for o in outputs[1:]] == [
        reference_no_repeat_greedy(reference, PROMPT, 12, n) for n in sizes[1:]]


def test_plain_greedy_repeats_a_bigram_that_the_plugin_prevents(gpt2_dir, reference):
    # Without this, the tests above could pass with a plugin that bans nothing.
    plain = testing.reference_greedy(reference, PROMPT, 12)
    assert has_repeated_ngram(PROMPT + plain, 2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, extra_args={"no_repeat_ngram_size": 2})
    assert not has_repeated_ngram(PROMPT + greedy_tokens(cpu_llm(gpt2_dir, plugins=["no-repeat-ngram"]), params), 2)


def test_no_repeat_ngram_changes_nothing_unless_asked(gpt2_dir, reference):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = cpu_llm(gpt2_dir, plugins=["no-repeat-ngram"])
    assert greedy_tokens(llm, params) == testing.reference_greedy(reference, PROMPT, 8)


def test_no_repeat_ngram_size_without_the_plugin_selected_is_refused_naming_it(gpt2_dir):
    with pytest.raises(ValueError, match=r"extra_args key 'no_repeat_ngram_size' .*select one with --plugin "
                                         r"no-repeat-ngram"):
        cpu_llm(gpt2_dir).generate({"prompt_token_ids": PROMPT},
                                   SamplingParams(extra_args={"no_repeat_ngram_size": 2}))


def engine_plugins_and_tokens(config: EngineConfig) -> tuple[list[str], list[int]]:
    """Build an engine from ``config`` alone (as a worker process does) and run one greedy request."""
    engine = LLMEngine(config)
    engine.add_request("0", PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                   extra_args={"no_repeat_ngram_size": 2}))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    return engine.active_plugins, outputs[0].outputs[0].token_ids


def test_spawned_process_rebuilds_the_same_plugins_from_the_engine_config(gpt2_dir):
    config = EngineConfig(str(gpt2_dir), plugins=["no-repeat-ngram"], device="cpu", dtype="float32", num_kv_blocks=16)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(engine_plugins_and_tokens, (config,))
    parent = engine_plugins_and_tokens(config)
    assert parent == child
    assert parent[0] == ["core", "no-repeat-ngram", "gpt2"] and not has_repeated_ngram(PROMPT + parent[1], 2)


def test_no_repeat_ngram_route_is_served_when_the_plugin_is_active_only(gpt2_dir):
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
                return await http.get("/v1/no-repeat-ngram/banned", params={"text": "w5 w17 w5 w9 w5", "size": 2})
        finally:
            engine.shutdown()

    # "w5" was followed by w17 and w9: ending the text with w5, those two would repeat a bigram.
    assert asyncio.run(get(["no-repeat-ngram"])).json() == {"text": "w5 w17 w5 w9 w5", "size": 2, "token_ids": [9, 17]}
    assert asyncio.run(get([])).status_code == 404
