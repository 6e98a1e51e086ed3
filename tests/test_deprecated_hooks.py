"""A plugin written against the previous release's hook names and arguments keeps working for a
release, with a DeprecationWarning naming the hook to implement instead."""

from __future__ import annotations

import types

import pytest

from hookllm import EngineConfig, LLMEngine, SamplingParams, hookimpl
from hookllm.plugins.components import ComponentKind
from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins
from hookllm.plugins.tool_parser import TaggedToolParser

PROMPT = {"prompt_token_ids": list(range(2, 12))}


def engine_with(tiny_llama_dir, **hooks) -> LLMEngine:
    """An engine on the tiny Llama with a module plugin ``old`` implementing ``hooks``, selected."""
    module = types.ModuleType("old")
    for name, function in hooks.items():
        setattr(module, name, hookimpl(function))
    plugins = discover_plugins()
    plugins["old"] = PluginInfo("old", module)
    config = EngineConfig(str(tiny_llama_dir), plugins=["old"], device="cpu", dtype="float32", num_kv_blocks=64)
    return LLMEngine(config, PluginManager(plugins))


def run_to_end(engine: LLMEngine) -> None:
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()


def test_a_renamed_hook_under_its_old_name_still_runs_and_warns_naming_the_new_one(tiny_llama_dir):
    completed = []
    with pytest.warns(DeprecationWarning, match=r"request_completed\(output, context\), deprecated: "
                                                r"implement engine_request_finished\(output, context\)"):
        engine = engine_with(tiny_llama_dir, request_completed=lambda output: completed.append(output))
    run_to_end(engine)
    assert [(output.request_id, len(output.outputs[0].token_ids)) for output in completed] == [("r", 3)]


def test_a_hook_with_its_old_arguments_gets_them_from_the_context_and_warns(tiny_llama_dir):
    seen = []
    with pytest.warns(DeprecationWarning, match=r"implement preprocess_request\(request, context\)"):
        engine = engine_with(tiny_llama_dir, preprocess_request=lambda request, tokenizer, model_config:
                             seen.append((request.request_id, tokenizer, model_config)))
    run_to_end(engine)
    assert seen == [("r", engine.tokenizer, engine.model_config)]


class OldParserPlugin:
    """A class plugin registering a tool parser through the old registration hook."""

    @staticmethod
    @hookimpl
    def register_tool_parsers():
        return {"bracket": BracketParser}


class BracketParser(TaggedToolParser):
    start, end = "[call]", "[/call]"


def test_an_old_registration_hook_registers_its_components_and_warns_naming_register_components():
    with pytest.warns(DeprecationWarning, match=r"register_tool_parsers\(\), deprecated: "
                                                r"implement register_components\(components\)"):
        manager = PluginManager({"bracket": PluginInfo("bracket", OldParserPlugin)})
    assert manager.component(ComponentKind.TOOL_PARSER, "bracket") is BracketParser
    assert manager.plugins["bracket"].components.names(ComponentKind.TOOL_PARSER) == ["bracket"]
