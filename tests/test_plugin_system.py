"""Fault isolation and selection rules, with throwaway plugin distributions written to a folder on sys.path."""

from __future__ import annotations

import json
import sys
import textwrap
from typing import Callable

import pytest

from hookllm import LLM, EngineConfig, LLMEngine, SamplingParams, testing
from hookllm.entrypoints.cli import main
from hookllm.worker.model_runner import SamplerContractError
from hookllm.plugins.manager import PluginManager

PROMPT = [3, 14, 15, 92, 65]

REGISTER_NOTHING = """
from hookllm import hookimpl

@hookimpl
def register_models(registry):
    pass
"""


@pytest.fixture(autouse=True)
def all_plugins(monkeypatch):
    monkeypatch.delenv("HOOKLLM_PLUGINS", raising=False)


@pytest.fixture
def make_plugin(tmp_path, monkeypatch) -> Callable[[str, str], None]:
    """Install a plugin without pip: its module plus a ``*.dist-info`` with the entry point."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def make(name: str, source: str) -> None:
        module = "fake_plugin_" + name.replace("-", "_")
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        dist_info = site / f"{module}-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (dist_info / "entry_points.txt").write_text(f"[hookllm.plugins]\n{name} = {module}\n")
        modules.append(module)

    yield make
    for module in modules:
        sys.modules.pop(module, None)


@pytest.fixture(scope="module")
def expected_tokens(tiny_llama_reference) -> list[int]:
    return testing.reference_greedy(tiny_llama_reference, PROMPT, 6)


def greedy_tokens(llm: LLM) -> list[int]:
    return llm.generate({"prompt_token_ids": PROMPT}, testing.greedy(6))[0].outputs[0].token_ids


def sampler_plugin(body: str) -> str:
    return f"from hookllm import hookimpl\n\n@hookimpl\ndef sample(logits, batch):\n    {body}\n"


def test_plugin_that_fails_to_import_is_listed_with_its_error(make_plugin, capsys):
    make_plugin("broken", "raise ImportError('needs libfoo 2.0')")
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["broken"]["error"] == "ImportError: needs libfoo 2.0"
    assert rows["llama"]["error"] is None and rows["llama"]["architectures"]


def test_plugin_that_fails_to_import_leaves_the_others_working(make_plugin, make_llm, expected_tokens):
    make_plugin("broken", "raise ImportError('needs libfoo 2.0')")
    assert greedy_tokens(make_llm()) == expected_tokens


def test_selecting_a_plugin_that_failed_to_import_raises_its_error(make_plugin, make_llm):
    make_plugin("broken", "raise ImportError('needs libfoo 2.0')")
    with pytest.raises(ValueError, match=r"plugin 'broken' failed to load: ImportError: needs libfoo 2\.0"):
        make_llm(plugins=["broken"])


def test_hookimpl_of_an_unknown_hook_is_a_load_error_naming_plugin_and_hook(make_plugin):
    make_plugin("typo", "from hookllm import hookimpl\n\n@hookimpl\ndef proces_logits(logits, batch):\n    pass\n")
    info = PluginManager().plugins["typo"]
    assert info.module is None
    assert "plugin 'typo' implements unknown hook(s) proces_logits" in info.error


def test_hookllm_plugins_env_limits_which_entry_points_load(make_plugin, monkeypatch):
    make_plugin("a", REGISTER_NOTHING)
    make_plugin("b", REGISTER_NOTHING)
    make_plugin("c", "raise RuntimeError('c must not even be imported')")
    monkeypatch.setenv("HOOKLLM_PLUGINS", "a, b")
    assert sorted(PluginManager().plugins) == ["a", "b"]


def test_empty_hookllm_plugins_loads_none_so_llama_has_no_adapter(monkeypatch, make_llm):
    monkeypatch.setenv("HOOKLLM_PLUGINS", "")
    assert PluginManager().plugins == {}
    with pytest.raises(ValueError, match="no installed plugin serves architecture 'LlamaForCausalLM'"):
        make_llm()


RIVAL_LLAMA = """
from hookllm import hookimpl
from hookllm.adapters.llama.model import LlamaForCausalLM

class RivalLlama(LlamaForCausalLM):
    pass

@hookimpl
def register_models(registry):
    registry.register("LlamaForCausalLM", RivalLlama)
"""


def test_architecture_registered_by_two_plugins_is_an_error_naming_both(make_plugin, make_llm):
    make_plugin("rival", RIVAL_LLAMA)
    with pytest.raises(ValueError, match=r"'LlamaForCausalLM' is registered by several plugins \(llama, rival\)"):
        make_llm()


@pytest.mark.parametrize("selected, model_class", [("rival", "RivalLlama"), ("llama", "LlamaForCausalLM")])
def test_selected_plugin_wins_an_architecture_conflict(make_plugin, make_llm, selected, model_class):
    make_plugin("rival", RIVAL_LLAMA)
    llm = make_llm(plugins=[selected])
    assert type(llm.engine.worker.model).__name__ == model_class


def test_unknown_plugin_name_error_lists_installed_plugins(make_llm):
    with pytest.raises(ValueError, match=r"unknown plugin 'nope'; installed plugins: .*llama"):
        make_llm(plugins=["nope"])


def test_cli_reports_unknown_plugin_and_exits_2(tiny_llama_dir, capsys):
    assert main(["generate", "--model", str(tiny_llama_dir), "--plugin", "nope", "hi"]) == 2
    assert "unknown plugin 'nope'; installed plugins:" in capsys.readouterr().err


@pytest.mark.parametrize("body, got", [
    ("return logits.argmax(-1).float()", "dtype torch.float32"),
    ("return logits.argmax(-1)[:-1]", r"shape \(0,\)"),
], ids=["floats", "wrong-length"])
def test_sample_hook_breaking_its_contract_fails_the_first_step_naming_the_plugin(
    make_plugin, tiny_llama_dir, body, got
):
    make_plugin("bad-sampler", sampler_plugin(body))
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), plugins=["bad-sampler"], device="cpu", num_kv_blocks=32))
    engine.add_request("0", PROMPT, testing.greedy(4))
    message = rf"plugin 'bad-sampler': the sample hook must return a 1-D torch.long tensor .*got .*{got}"
    with pytest.raises(SamplerContractError, match=message) as error:
        engine.step()
    assert isinstance(error.value, RuntimeError)


def test_llm_serves_again_after_a_plugin_fails_a_request(make_plugin, make_llm, expected_tokens):
    make_plugin("flaky", sampler_plugin(
        "if any(r.sampling_params.extra_args.get('explode') for r in batch.sampling_requests):\n"
        "        raise RuntimeError('exploded')"
    ))
    llm = make_llm(plugins=["flaky"])
    with pytest.raises(RuntimeError, match="exploded"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(extra_args={"explode": True}))
    assert greedy_tokens(llm) == expected_tokens
    testing.assert_all_blocks_free(llm)


WRAPPING_SAMPLER = """
from hookllm import hookimpl

@hookimpl(wrapper=True)
def sample(logits, batch):
    tokens = yield  # whatever the sampler (the core's greedy here) chose
    return (tokens + 1) % logits.shape[-1]
"""


def test_a_sample_hook_wrapper_sees_and_replaces_the_sampled_tokens(make_plugin, make_llm, expected_tokens):
    make_plugin("shift", WRAPPING_SAMPLER)
    llm = make_llm(plugins=["shift"])
    # Each step's greedy token shifted by one: the first differs from the reference by exactly that.
    first = llm.generate({"prompt_token_ids": PROMPT}, testing.greedy(1))[0].outputs[0].token_ids
    assert first == [(expected_tokens[0] + 1) % 320]
