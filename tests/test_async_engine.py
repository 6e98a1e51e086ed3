"""AsyncLLM on its own and the app in-process: deltas, bad input, aborts, a plugin failing mid-step."""

from __future__ import annotations

import asyncio
import types

import httpx
import openai
import pytest

from hookllm import EngineConfig, LLMEngine, SamplingParams, hookimpl
from hookllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from hookllm.engine.loop import EngineLoop
from hookllm.engine.messages import (AddRequest, CompletionDelta, OutputDelta, PromptHead, RequestAdded, Shutdown,
                                     merge_deltas)
from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins
from hookllm.server.app import ServerSettings, build_app


@hookimpl
def process_logits(logits, batch):
    for request in batch.sampling_requests:
        if request.sampling_params.extra_args.get("explode"):
            raise RuntimeError("boom")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    """An AsyncLLM whose active plugins include one that raises for requests asking it to."""
    plugins = discover_plugins()
    module = types.ModuleType("boom")
    module.process_logits = process_logits
    plugins["boom"] = PluginInfo("boom", module)
    config = EngineConfig(str(tiny_llama_dir), plugins=["boom"], device="cpu", dtype="float32", num_kv_blocks=32)
    engine = AsyncLLM(LLMEngine(config, PluginManager(plugins)))
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


async def collect(engine: AsyncLLM, prompt, params) -> tuple[str, list[int], list]:
    text, ids, outputs = "", [], []
    async for output in engine.generate(prompt, params):
        outputs.append(output)
        text += output.outputs[0].text
        ids += output.outputs[0].token_ids
    return text, ids, outputs


def test_generate_yields_deltas_that_join_to_the_offline_output(engine, make_llm):
    expected = make_llm(num_kv_blocks=32).generate(["Hello", "Bye now"], greedy(10))

    async def both() -> list:
        return await asyncio.gather(collect(engine, "Hello", greedy(10)), collect(engine, "Bye now", greedy(10)))

    results = asyncio.run(asyncio.wait_for(both(), 30))
    for (text, ids, outputs), offline in zip(results, expected):
        assert (text, ids) == (offline.outputs[0].text, offline.outputs[0].token_ids)
        assert all(o.outputs[0].token_ids for o in outputs)  # every delta brings tokens
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


def test_bad_input_raises_value_error_to_the_caller(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(collect(engine, [5] * 10_000, greedy(4)))
    assert engine.get_stats().num_used_blocks == 0


def test_cancelled_consumer_aborts_its_request_at_once(engine):
    async def cancel_after_first_token() -> None:
        async def consume() -> None:
            async for _ in engine.generate("story", greedy(200, ignore_eos=True)):
                started.set()
        started = asyncio.Event()
        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()
        for _ in range(200):  # the abort runs before the engine's next step
            if engine.get_stats().num_used_blocks == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(cancel_after_first_token())
    assert (engine.get_stats().num_running_reqs, engine.get_stats().num_used_blocks) == (0, 0)


def test_a_plugin_raising_mid_step_fails_its_request_and_the_engine_serves_on(engine, make_llm):
    expected = make_llm(num_kv_blocks=32).generate("Hello", greedy(6))[0].outputs[0].text
    with pytest.raises(EngineStepError, match="boom"):
        asyncio.run(collect(engine, "Hello", greedy(6, extra_args={"explode": True})))
    assert engine.get_stats().num_used_blocks == 0
    assert asyncio.run(collect(engine, "Hello", greedy(6)))[0] == expected


def test_a_plugin_raising_mid_step_is_a_500_through_the_server(engine, make_llm):
    expected = make_llm(num_kv_blocks=32).generate("Hello", greedy(6))[0].outputs[0].text

    async def run() -> str:
        app = build_app(engine, ServerSettings(served_model_names=["tiny"]))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
        async with openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=http,
                                      max_retries=0) as client:
            with pytest.raises(openai.InternalServerError, match="boom"):
                await client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0,
                                                extra_body={"extra_args": {"explode": True}})
            response = await client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
            return response.choices[0].text

    assert asyncio.run(asyncio.wait_for(run(), 30)) == expected


def test_a_slow_consumer_gets_the_deltas_that_piled_up_as_one(engine, make_llm):
    expected = make_llm(num_kv_blocks=32).generate("Hello", greedy(12, ignore_eos=True))[0].outputs[0]

    async def read_first_then_wait() -> list:
        outputs = []
        async for output in engine.generate("Hello", greedy(12, ignore_eos=True)):
            outputs.append(output)
            for _ in range(500):  # let the engine finish the request before reading on
                if engine.get_stats().num_running_reqs == 0:
                    break
                await asyncio.sleep(0.01)
        return outputs

    first, rest = asyncio.run(asyncio.wait_for(read_first_then_wait(), 30))
    assert first.outputs[0].token_ids + rest.outputs[0].token_ids == expected.token_ids
    assert first.outputs[0].text + rest.outputs[0].text == expected.text
    assert (first.finished, rest.finished, rest.outputs[0].finish_reason) == (False, True, "length")
    assert rest.prompt_token_ids == first.prompt_token_ids


def test_merged_deltas_join_text_tokens_and_logprobs_and_keep_the_head():
    head = PromptHead("Hi", [5, 6], None, 0, None)
    first = OutputDelta("r", False, head, [CompletionDelta(0, "He", [1], -0.5, [{1: "a"}], None, None)], None)
    later = OutputDelta("r", True, None, [CompletionDelta(0, "llo", [2, 3], -1.5, [{2: "b"}, {3: "c"}], "length",
                                                          None)], "metrics")
    assert merge_deltas(first, later) == OutputDelta(
        "r", True, head, [CompletionDelta(0, "Hello", [1, 2, 3], -1.5, [{1: "a"}, {2: "b"}, {3: "c"}], "length", None)],
        "metrics")


@pytest.fixture(scope="module")
def engine_process(tiny_llama_dir):
    """An AsyncLLM whose engine runs in a process of its own, as the server's does."""
    engine = AsyncLLM.from_engine_config(EngineConfig(str(tiny_llama_dir), device="cpu", dtype="float32",
                                                      num_kv_blocks=32))
    yield engine
    engine.shutdown()


def test_an_engine_process_gives_the_offline_outputs(engine_process, make_llm):
    expected = make_llm(num_kv_blocks=32).generate(["Hello", "Bye now"], greedy(10))

    async def both() -> list:
        return await asyncio.gather(*(collect(engine_process, p, greedy(10)) for p in ["Hello", "Bye now"]))

    for (text, ids, outputs), offline in zip(asyncio.run(asyncio.wait_for(both(), 60)), expected):
        assert (text, ids) == (offline.outputs[0].text, offline.outputs[0].token_ids)
        assert all(o.prompt_token_ids == offline.prompt_token_ids for o in outputs)


def test_an_engine_process_reports_logprobs_whose_texts_its_client_decodes(engine_process, make_llm):
    params = greedy(5, logprobs=2)
    expected = make_llm(num_kv_blocks=32).generate("Hello", params)[0].outputs[0].logprobs
    _, _, outputs = asyncio.run(asyncio.wait_for(collect(engine_process, "Hello", params), 60))
    streamed = [entry for output in outputs for entry in output.outputs[0].logprobs]
    texts = [{token: lp.decoded_token for token, lp in entry.items()} for entry in streamed]
    assert texts == [{token: lp.decoded_token for token, lp in entry.items()} for entry in expected]
    assert [list(entry) for entry in streamed] == [list(entry) for entry in expected]


def test_an_engine_process_refuses_bad_input_with_value_error(engine_process):
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(asyncio.wait_for(collect(engine_process, [5] * 10_000, greedy(4)), 30))


def test_an_engine_process_that_dies_fails_its_requests_and_marks_the_server_down(tiny_llama_dir):
    engine = AsyncLLM.from_engine_config(EngineConfig(str(tiny_llama_dir), device="cpu", dtype="float32",
                                                      num_kv_blocks=8))

    async def generate_while_killed() -> None:
        async for _ in engine.generate("story", greedy(100, ignore_eos=True)):
            engine._loop.process.process.kill()

    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(generate_while_killed(), 60))
    assert not engine.is_running
    engine.shutdown()


def test_shutdown_stops_the_engine_process_and_refuses_new_requests(tiny_llama_dir):
    engine = AsyncLLM.from_engine_config(EngineConfig(str(tiny_llama_dir), device="cpu", dtype="float32",
                                                      num_kv_blocks=8))
    engine.shutdown()
    assert engine._loop.process.process.exitcode == 0
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "Hello", greedy(2)))


def run_engine_loop(tiny_llama_dir, script: list[tuple[int, int, tuple]], num_clients: int) -> dict[int, list]:
    """``EngineLoop`` over a fresh engine with ``num_clients`` clients, fed ``script``: each
    ``(after, client, command)`` is received once ``after`` reports have gone out (or at once when
    the engine is idle). Returns each client's reports, in order."""
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=32))
    pending = list(script)
    reports: dict[int, list] = {client: [] for client in range(num_clients)}

    def receive(block: bool):
        sent = sum(len(r) for r in reports.values())
        if pending and (block or pending[0][0] <= sent):
            _, client, command = pending.pop(0)
            return client, command
        return None

    EngineLoop(engine, receive, lambda client, report: reports[client].append(report), num_clients).run()
    return reports


def outputs_by_request(reports: list) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for report in reports:
        for delta in report.outputs:
            outputs.setdefault(delta.request_id, []).append(delta)
    return outputs


def test_an_engine_loop_sends_each_request_to_the_client_that_added_it(tiny_llama_dir):
    reports = run_engine_loop(tiny_llama_dir, [
        (0, 0, AddRequest("a", {"prompt_token_ids": [5, 6, 7]}, greedy(4))),
        (0, 1, AddRequest("b", {"prompt_token_ids": [8, 9]}, greedy(6))),
        (0, 1, AddRequest("c", {"prompt_token_ids": [1] * 4096}, greedy(1))),  # too long: refused
        (10**6, 0, Shutdown()), (10**6, 1, Shutdown()),
    ], num_clients=2)
    assert [added for r in reports[0] for added in r.added] == [RequestAdded("a")]
    assert [added.request_id for r in reports[1] for added in r.added] == ["b", "c"]
    assert [added.error[0] for r in reports[1] for added in r.added if added.error] == ["ValueError"]
    zero, one = outputs_by_request(reports[0]), outputs_by_request(reports[1])
    assert list(zero) == ["a"] and list(one) == ["b"]
    # Outputs are cumulative here (AsyncLLM asks for deltas): the last holds every token.
    assert len(zero["a"][-1].completions[0].token_ids) == 4 and zero["a"][-1].finished
    assert len(one["b"][-1].completions[0].token_ids) == 6 and one["b"][-1].finished
    assert reports[0][-1].closed and reports[1][-1].closed


def test_a_client_that_shuts_down_has_its_requests_aborted_while_the_others_go_on(tiny_llama_dir):
    reports = run_engine_loop(tiny_llama_dir, [
        (0, 0, AddRequest("a", {"prompt_token_ids": [5, 6, 7]}, greedy(40, ignore_eos=True))),
        (0, 1, AddRequest("b", {"prompt_token_ids": [8, 9]}, greedy(40, ignore_eos=True))),
        (6, 0, Shutdown()),
        (10**6, 1, Shutdown()),
    ], num_clients=2)
    assert reports[0][-1].closed
    zero, one = outputs_by_request(reports[0]), outputs_by_request(reports[1])
    assert not zero["a"][-1].finished and len(zero["a"][-1].completions[0].token_ids) < 40  # cut off
    assert one["b"][-1].finished and len(one["b"][-1].completions[0].token_ids) == 40
    assert reports[1][-1].closed
