"""Fault isolation and selection rules, with throwaway plugin distributions written to a folder on sys.path."""

from __future__ import annotations

import json
import sys
import textwrap
import types
from typing import Callable

import pytest
import torch

from hookllm import LLM, EngineConfig, LLMEngine, PoolingParams, SamplingParams, testing
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
def make_plugin(tmp_path, monkeypatch) -> Callable[..., None]:
    """Install a plugin without pip: its module plus a ``*.dist-info`` with the entry point."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def make(name: str, source: str, attribute: str = "") -> None:
        """``attribute``: the entry point names that object of the module (a class plugin)."""
        module = "fake_plugin_" + name.replace("-", "_")
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        dist_info = site / f"{module}-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        target = f"{module}:{attribute}" if attribute else module
        (dist_info / "entry_points.txt").write_text(f"[hookllm.plugins]\n{name} = {target}\n")
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
    assert type(llm.engine.engine_core.executor.model).__name__ == model_class


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


COUNTING_CLASS = """
from hookllm import hookimpl

class Counter:
    instances = []

    def __init__(self):
        self.rows = 0
        Counter.instances.append(self)

    @hookimpl
    def process_logits(self, logits):
        self.rows += logits.shape[0]
"""


def test_a_class_plugin_is_instantiated_once_per_engine(make_plugin, make_llm):
    make_plugin("counter", COUNTING_CLASS, "Counter")
    engines = [make_llm(plugins=["counter"]), make_llm(plugins=["counter"])]
    counter_class = sys.modules["fake_plugin_counter"].Counter
    assert counter_class.instances == [llm.engine.hooks.pm.get_plugin("counter") for llm in engines]


def test_two_engines_in_one_process_share_no_class_plugin_state(make_plugin, make_llm):
    make_plugin("counter", COUNTING_CLASS, "Counter")
    make_plugin("other", REGISTER_NOTHING)
    first, second = make_llm(plugins=["counter"]), make_llm(plugins=["other", "counter"])
    first.generate({"prompt_token_ids": PROMPT}, testing.greedy(3))
    second.generate({"prompt_token_ids": PROMPT}, testing.greedy(5))
    # One sampling row per step, one step per token.
    assert [llm.engine.hooks.pm.get_plugin("counter").rows for llm in (first, second)] == [3, 5]


def test_two_engines_in_one_process_get_their_own_state_for_a_module_plugin(make_plugin, make_llm):
    make_plugin("rows", """
        from hookllm import hookimpl

        @hookimpl
        def process_logits(logits, context):
            state = context.state_for(__name__)
            state.rows = getattr(state, "rows", 0) + logits.shape[0]
    """)
    first, second = make_llm(plugins=["rows"]), make_llm(plugins=["rows"])
    first.generate({"prompt_token_ids": PROMPT}, testing.greedy(3))
    second.generate({"prompt_token_ids": PROMPT}, testing.greedy(5))
    assert [llm.engine.hooks.context.state_for("fake_plugin_rows").rows for llm in (first, second)] == [3, 5]


def test_a_class_plugin_with_an_instance_method_for_register_models_is_a_load_error(make_plugin):
    make_plugin("unbound", """
        from hookllm import hookimpl

        class Unbound:
            @hookimpl
            def register_models(self, registry):
                pass
    """, "Unbound")
    assert "register_models run before any engine (so any instance) exists" in PluginManager().plugins["unbound"].error


RECORDING_HOOKS = """
from hookllm import hookimpl

calls = []

@hookimpl
def register_models(registry):
    {register}

@hookimpl
def preprocess_request(request):
    calls.append("preprocess_request")

@hookimpl
def prepare_inputs(batch):
    calls.append("prepare_inputs")
"""


@pytest.mark.parametrize("register, expected_calls", [
    ('registry.register("FooForCausalLM", "nowhere:Foo")', []),  # an adapter of another architecture
    ("pass", ["preprocess_request", "prepare_inputs"]),  # a hook-only plugin
], ids=["adapter", "hook-only"])
def test_model_scoped_hooks_reach_hook_only_plugins_but_not_another_architectures_adapter(
    make_plugin, make_llm, register, expected_calls
):
    make_plugin("recorder", RECORDING_HOOKS.format(register=register))
    make_llm(plugins=["recorder"]).generate({"prompt_token_ids": PROMPT}, testing.greedy(1))
    assert sys.modules["fake_plugin_recorder"].calls == expected_calls


CLAIMING_PLUGIN = """
from hookllm import hookimpl
from hookllm.plugins.context import RequestParameters

@hookimpl
def claim_request_parameters():
    return RequestParameters(extra_args=("tag",), modalities=("audio",))

@hookimpl
def add_cli_options(parser):
    parser.add_argument("--shout", action="store_true", dest="shout")
"""


@pytest.mark.parametrize("prompt, extra_args, parameter", [
    (PROMPT, {"tag": "x"}, "extra_args key 'tag'"),
    (PROMPT, {"shout": True}, "extra_args key 'shout'"),  # an add_cli_options dest
    ({"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": [b"..."]}}, {}, "multi_modal_data 'audio'"),
], ids=["declared-key", "cli-dest", "modality"])
def test_a_parameter_of_an_installed_but_inactive_plugin_is_refused_naming_it_and_the_plugin(
    make_plugin, make_llm, prompt, extra_args, parameter
):
    make_plugin("claimer", CLAIMING_PLUGIN)
    engine = make_llm().engine
    message = (rf"request r: no active plugin takes {parameter} for LlamaForCausalLM; "
               r"select one with --plugin claimer / LLM\(plugins=\['claimer'\]\)")
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", prompt, SamplingParams(extra_args=extra_args))
    assert not engine.has_request("r")


@pytest.mark.parametrize("extra_args", [{"shout": False}, {"my_own_key": 1}], ids=["flag-default", "unclaimed-key"])
def test_extra_args_at_a_flag_default_or_claimed_by_no_plugin_are_allowed(make_plugin, make_llm, expected_tokens,
                                                                          extra_args):
    make_plugin("claimer", CLAIMING_PLUGIN)
    params = SamplingParams(max_tokens=6, temperature=0.0, extra_args=extra_args)
    assert make_llm().generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids == expected_tokens


def test_extra_args_key_of_an_active_plugin_is_allowed(make_plugin, make_llm, expected_tokens):
    make_plugin("claimer", CLAIMING_PLUGIN)
    params = SamplingParams(max_tokens=6, temperature=0.0, extra_args={"tag": "x"})
    llm = make_llm(plugins=["claimer"])
    assert llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids == expected_tokens


# A structured output backend for JSON schemas that takes the constraint (and enforces nothing):
# enough to see which plugin the server chose, and that the engine let it take the request.
JSON_BACKEND_PLUGIN = """
import dataclasses

from hookllm import hookimpl
from hookllm.plugins.context import RequestParameters

@hookimpl
def register_components(components):
    components.add_structured_output_backend("fake-json", ["json"])

@hookimpl
def claim_request_parameters():
    return RequestParameters(sampling_params=("structured_outputs",))

@hookimpl
def preprocess_request(request):
    params = request.sampling_params
    if params.structured_outputs is not None:
        request.sampling_params = dataclasses.replace(params, structured_outputs=None)
"""


def required_tool_choice(engine):
    """``chat_tools`` for a ``tool_choice: "required"`` request on a server over ``engine``."""
    from hookllm.server.protocol import ChatCompletionRequest
    from hookllm.server.state import ServerSettings
    from hookllm.server.tool_calling import chat_tools

    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="required")
    state = types.SimpleNamespace(settings=ServerSettings(served_model_names=["x"]), engine=engine)
    return chat_tools(state, body)


def test_tool_choice_required_activates_the_installed_plugin_with_a_json_schema_backend(make_plugin, make_llm,
                                                                                        monkeypatch):
    from hookllm.server.tool_calling import with_json_schema_plugin

    make_plugin("jsonfake", JSON_BACKEND_PLUGIN)
    monkeypatch.setenv("HOOKLLM_PLUGINS", "llama,jsonfake")  # the bundled structured plugin is not there
    plugins = with_json_schema_plugin(["llama"], PluginManager())
    assert plugins == ["llama", "jsonfake"]
    engine = make_llm(plugins=plugins).engine
    tools = required_tool_choice(engine)
    params = tools.constrain(SamplingParams(max_tokens=2))
    assert params.structured_outputs.json["minItems"] == 1
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params)  # taken by jsonfake, so not refused
    assert engine.has_request("r")


def test_tool_choice_required_without_a_json_schema_backend_is_a_400_saying_what_to_install(make_plugin, make_llm,
                                                                                            monkeypatch):
    from hookllm.server.errors import OpenAIError
    from hookllm.server.tool_calling import with_json_schema_plugin

    make_plugin("claimer", CLAIMING_PLUGIN)  # takes other parameters, enforces no schema
    monkeypatch.setenv("HOOKLLM_PLUGINS", "llama,claimer")
    plugins = with_json_schema_plugin(["llama", "claimer"], PluginManager())
    assert plugins == ["llama", "claimer"]
    with pytest.raises(OpenAIError, match=r"install llguidance .* or a plugin with a structured output backend "
                                          r"for JSON schemas") as error:
        required_tool_choice(make_llm(plugins=plugins).engine)
    assert (error.value.status, error.value.param) == (400, "tool_choice")


def test_a_plugins_pooler_is_chosen_by_name(make_plugin, tiny_llama_dir, tiny_llama_reference):
    make_plugin("maxpool", """
        from hookllm import hookimpl

        def max_over_tokens(hidden_states, request):
            return hidden_states.max(dim=0).values

        @hookimpl
        def register_components(components):
            components.add_pooler("max", max_over_tokens)
    """)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling", pooler="max",
              max_num_batched_tokens=16)  # the pooler sees the whole prompt, chunks joined
    prompt = list(range(3, 40))
    [output] = llm.embed([prompt], PoolingParams(normalize=False))
    with torch.no_grad():
        want = tiny_llama_reference.model(torch.tensor([prompt])).last_hidden_state[0].max(dim=0).values
    torch.testing.assert_close(torch.tensor(output.outputs.embedding), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no installed plugin provides a pooler named 'nope'"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", runner="pooling", pooler="nope")
