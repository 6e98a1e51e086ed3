"""A step that raises ends every request the engine holds (aborted, blocks freed) and the
exception reaches the caller; the next steps run as before, for direct LLMEngine users too."""

from __future__ import annotations

import types

import pytest

from hookllm import EngineConfig, LLMEngine, SamplingParams, hookimpl, testing
from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@hookimpl
def process_logits(logits, batch):
    if any(r.sampling_params.extra_args.get("explode") for r in batch.sampling_requests):
        raise RuntimeError("boom")


def make_engine(tiny_llama_dir, async_scheduling: bool) -> LLMEngine:
    plugins = discover_plugins()
    module = types.ModuleType("boom")
    module.process_logits = process_logits
    plugins["boom"] = PluginInfo("boom", module)
    config = EngineConfig(str(tiny_llama_dir), plugins=["boom"], device="cpu", dtype="float32", num_kv_blocks=32,
                          async_scheduling=async_scheduling)
    return LLMEngine(config, PluginManager(plugins))


def run_to_end(engine: LLMEngine, max_steps: int = 100) -> list:
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"the engine still has requests after {max_steps} steps")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_step_ends_every_request_and_the_engine_serves_on(tiny_llama_dir, async_scheduling):
    engine = make_engine(tiny_llama_dir, async_scheduling)
    expected = run_to_end_of(engine, "before", testing.greedy(4))
    engine.add_request("bystander", PROMPT, testing.greedy(20))
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=20, extra_args={"explode": True}))
    with pytest.raises(RuntimeError, match="boom"):
        run_to_end(engine)
    assert not engine.has_request("bystander") and not engine.has_request("bad")
    assert engine.get_num_unfinished_requests() == 0
    assert run_to_end(engine) == []  # nothing is left to step
    assert run_to_end_of(engine, "after", testing.greedy(4)) == expected
    blocks = engine.engine_core.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def run_to_end_of(engine: LLMEngine, request_id: str, params: SamplingParams) -> list[int]:
    engine.add_request(request_id, PROMPT, params)
    [final] = [o for o in run_to_end(engine) if o.request_id == request_id and o.finished]
    return final.outputs[0].token_ids
