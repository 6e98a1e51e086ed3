"""The engine's three layers: input processing, the engine core, output processing; and the
``engine_request_finished`` hook, which the output processor calls once per request."""

from __future__ import annotations

import dataclasses
import types

import msgspec
import pytest

from hookllm import EngineConfig, LLMEngine, SamplingParams, hookimpl, testing
from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins

PROMPT = {"prompt_token_ids": list(range(2, 30))}


@pytest.fixture
def recording_engine(tiny_llama_dir):
    """An engine whose active plugins include one recording every ``engine_request_finished`` call."""
    completed = []
    module = types.ModuleType("recorder")
    module.engine_request_finished = hookimpl(lambda output: completed.append(output))
    plugins = discover_plugins()
    plugins["recorder"] = PluginInfo("recorder", module)
    config = EngineConfig(str(tiny_llama_dir), plugins=["recorder"], device="cpu", dtype="float32", num_kv_blocks=64)
    engine = LLMEngine(config, PluginManager(plugins))
    engine.completed = completed
    return engine


def run_to_end(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_engine_request_finished_gets_the_complete_output_once_whatever_the_output_kind(recording_engine):
    engine = recording_engine
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   output_kind="delta", logprobs=1))
    deltas = [o for o in run_to_end(engine) if o.request_id == "r"]
    [done] = engine.completed
    assert done.request_id == "r" and done.finished and done.prompt_token_ids == PROMPT["prompt_token_ids"]
    completion = done.outputs[0]
    assert completion.token_ids == [t for d in deltas for t in d.outputs[0].token_ids]
    assert completion.text == "".join(d.outputs[0].text for d in deltas)
    assert len(completion.logprobs) == 6 and completion.finish_reason == "length"
    assert done.metrics.finished_time >= done.metrics.first_token_time >= done.metrics.arrival_time


def test_engine_request_finished_for_n_gets_the_parents_output_with_every_completion(recording_engine):
    engine = recording_engine
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request("p", PROMPT, params)
    # Cumulative outputs report each child under the parent's id as it advances.
    finished = {c.index: c.token_ids for o in run_to_end(engine) for c in o.outputs if c.finish_reason}
    [done] = engine.completed
    assert done.request_id == "p"
    assert [(c.index, c.token_ids) for c in done.outputs] == sorted(finished.items())


def test_engine_request_finished_for_an_aborted_request_says_abort_and_keeps_its_tokens(recording_engine):
    engine = recording_engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    [done] = engine.completed
    assert done.outputs[0].finish_reason == "abort" and done.outputs[0].token_ids
    engine.abort_request("a")  # already gone: no second call
    assert len(engine.completed) == 1


def test_a_stop_string_found_by_the_output_processor_ends_the_request_in_the_core(make_llm):
    llm = make_llm(num_kv_blocks=64)
    free = llm.generate(PROMPT, testing.greedy(12))[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:3]
    engine = llm.engine
    engine.add_request("s", PROMPT, dataclasses.replace(testing.greedy(12), stop=[stop]))
    [final] = [o for o in run_to_end(engine) if o.finished]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    assert free.text.startswith(final.outputs[0].text) and stop not in final.outputs[0].text
    assert not engine.engine_core.has_unfinished_requests()
    testing.assert_all_blocks_free(llm)


def test_the_engine_core_reports_token_ids_and_why_a_request_finished_and_no_text(make_llm):
    engine = make_llm(num_kv_blocks=64).engine
    request = engine.input_processor.process("c", PROMPT, testing.greedy(3))
    engine.engine_core.add_requests("c", [request])
    outputs = []
    while engine.engine_core.has_unfinished_requests():
        outputs += engine.engine_core.step().outputs
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1]
    assert [o.finish_reason for o in outputs] == [None, None, "length"]
    fields = [field for o in outputs for field in msgspec.structs.astuple(o)]
    assert not any(isinstance(field, str) and field not in ("c", "length") for field in fields)
