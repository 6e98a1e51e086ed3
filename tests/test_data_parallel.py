"""Data parallelism (``data_parallel_size`` engine processes behind one ``AsyncLLM``, what
``hookllm serve --data-parallel-size`` serves): requests go to the least loaded engine, answers
equal one engine's, an abort reaches the engine holding the request, and the gauges are per engine.
One ``AsyncLLM`` with two engine processes on the CPU serves the whole module."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hookllm import LLM, EngineConfig, SamplingParams
from hookllm.engine.async_llm import AsyncLLM
from hookllm.engine.core_client import data_parallel_devices, engine_devices
from hookllm.engine.dp_client import DataParallelClient, least_loaded, total_stats
from hookllm.engine.messages import AbortRequests, AddRequest, EngineReport, OutputDelta, encode_report
from hookllm.sched.scheduler import SchedulerStats
from hookllm.server.metrics import ServerMetrics

NUM_KV_BLOCKS = 64
# Token-id prompts of lengths 3..10: the engines' prompt-token counters tell which took which.
PROMPTS = [[10 + i] + list(range(20, 22 + i)) for i in range(8)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    engine = AsyncLLM(config=EngineConfig(str(tiny_llama_dir), device="cpu", dtype="float32",
                                          num_kv_blocks=NUM_KV_BLOCKS, data_parallel_size=2))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


def burst(engine: AsyncLLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    """Every prompt sent at once; each one's generated token ids."""

    async def one(prompt: list[int]) -> list[int]:
        outputs = [o async for o in engine.generate({"prompt_token_ids": prompt}, params)]
        return [t for output in outputs for t in output.outputs[0].token_ids]

    async def run() -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(*[one(p) for p in prompts]), 60)

    return asyncio.run(run())


def stats(running: int, waiting: int, used: int = 0, blocks: int = 0) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, num_used_blocks=used, num_blocks=blocks)


def test_a_new_request_goes_to_the_engine_with_the_least_work_counting_requests_not_yet_reported():
    # Loads: 3 + 1 + 0 = 4, 1 + 0 + 2 = 3, 0 + 2 + 0 = 2.
    assert least_loaded([stats(3, 1), stats(1, 0), stats(0, 2)], [0, 2, 0]) == 2


def test_equally_loaded_engines_give_the_request_to_the_lowest_index():
    # Loads: 3, 1 + 1 = 2, 1 + 1 = 2.
    assert least_loaded([stats(3, 0), stats(1, 0), stats(0, 1)], [0, 1, 1]) == 1


def test_the_servers_stats_sum_the_engines_and_kv_use_is_over_all_their_blocks():
    total = total_stats([stats(2, 1, used=10, blocks=100), stats(1, 3, used=30, blocks=50)])
    assert (total.num_running_reqs, total.num_waiting_reqs, total.num_used_blocks, total.num_blocks) == (3, 4, 40, 150)
    assert total.kv_cache_usage == pytest.approx(40 / 150)


def test_an_abort_goes_only_to_the_engine_holding_the_request_and_none_once_it_finished():
    # Two pipes whose far ends stand in for two engine processes.
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    for _, engine_end in pipes:
        engine_end.send_bytes(encode_report(EngineReport(stats(0, 0, blocks=NUM_KV_BLOCKS))))  # as a loop starts
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    client = DataParallelClient([ours for ours, _ in pipes], deliver=delivered.put, on_exit=lambda: None)
    try:
        for request_id in ("a", "b"):
            client.send(AddRequest(request_id, [5, 6], GREEDY))
        assert [engine_end.recv().request_id for _, engine_end in pipes] == ["a", "b"]
        client.send(AbortRequests(["b"]))
        assert pipes[1][1].poll(5) and pipes[1][1].recv() == AbortRequests(["b"])
        assert not pipes[0][1].poll(0.2)
        finished = OutputDelta("a", True, None, [], None)
        pipes[0][1].send_bytes(encode_report(EngineReport(stats(0, 0), outputs=[finished])))
        while not delivered.get(timeout=5).outputs:  # read on the client's reader thread (after the first reports)
            pass
        client.send(AbortRequests(["a"]))
        assert not pipes[0][1].poll(0.2)
    finally:
        for _, engine_end in pipes:
            engine_end.close()  # the engines are gone: the client's readers end
        client.close()


def test_each_engine_gets_its_own_run_of_the_visible_gpus():
    assert data_parallel_devices(["4", "5", "6", "7"], 2, 2) == ["4,5", "6,7"]
    assert data_parallel_devices(["0", "1", "2"], 3, 1) == ["0", "1", "2"]


def test_engines_on_cuda_split_the_gpus_of_cuda_visible_devices(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    config = EngineConfig(str(tiny_llama_dir), device="cuda", data_parallel_size=3)
    assert engine_devices(config) == ["2", "3", "5"]


def test_engines_on_the_cpu_keep_this_processs_devices(tiny_llama_dir):
    assert engine_devices(EngineConfig(str(tiny_llama_dir), device="cpu", data_parallel_size=2)) == [None, None]


def test_too_few_gpus_for_the_engines_is_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"data_parallel_size 2 x 2 GPU\(s\) per engine needs 4 GPUs; 3 visible"):
        data_parallel_devices(["0", "1", "2"], 2, 2)


def test_offline_llm_refuses_data_parallelism_pointing_at_hookllm_serve(tiny_llama_dir):
    with pytest.raises(ValueError, match="hookllm serve --data-parallel-size"):
        LLM(str(tiny_llama_dir), device="cpu", data_parallel_size=2)


def test_greedy_outputs_equal_one_engines(engines, offline):
    expected = [o.outputs[0].token_ids for o in offline.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert burst(engines, PROMPTS, GREEDY) == expected


def test_a_burst_alternates_between_two_idle_engines(engines):
    # Sent at once, request k finds engine k % 2 the least loaded (the ones sent before it count
    # though no report has counted them yet): each engine admits the prompt tokens of its half.
    before = [s.prefix_cache_queries for s in engines.engine_stats()]
    burst(engines, PROMPTS, GREEDY)
    admitted = [s.prefix_cache_queries - b for s, b in zip(engines.engine_stats(), before)]
    assert admitted == [sum(map(len, PROMPTS[0::2])), sum(map(len, PROMPTS[1::2]))]


def test_the_servers_stats_are_the_engines_summed(engines):
    assert [s.num_blocks for s in engines.engine_stats()] == [NUM_KV_BLOCKS, NUM_KV_BLOCKS]
    assert engines.get_stats().num_blocks == 2 * NUM_KV_BLOCKS


def test_metrics_show_each_engines_gauges_under_its_engine_label(engines):
    text = ServerMetrics(engines, "tiny").render().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "hookllm:num_kv_blocks")
    assert {(s.labels["engine"], s.labels["model_name"]): s.value for s in family.samples} == {
        ("0", "tiny"): NUM_KV_BLOCKS, ("1", "tiny"): NUM_KV_BLOCKS}


def test_an_abort_reaches_the_engine_holding_the_request_and_frees_it(engines):
    before = engines.engine_stats()

    async def start_then_abort() -> list[SchedulerStats]:
        stream = engines.generate(PROMPTS[0], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                                  request_id="long")
        await stream.__anext__()  # running on its engine
        holding = engines.engine_stats()
        engines.abort("long")
        await stream.aclose()
        return holding

    holding = asyncio.run(asyncio.wait_for(start_then_abort(), 30))
    engine = next(i for i, s in enumerate(holding) if s.num_running_reqs == 1)
    other = 1 - engine
    deadline = time.monotonic() + 10
    while engines.engine_stats()[engine].num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    after = engines.engine_stats()
    assert (after[engine].num_running_reqs, after[engine].num_waiting_reqs, after[engine].num_used_blocks) == (0, 0, 0)
    assert holding[other].num_running_reqs == 0
    assert after[other].prefix_cache_queries == before[other].prefix_cache_queries  # it never saw the request


def test_hookllm_serve_with_two_engines_answers_over_http_as_one_engine_and_counts_per_engine(tiny_llama_dir, offline):
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from server_fixtures import Server

    server = Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--served-model-name", "tiny",
                     "--num-kv-blocks", str(NUM_KV_BLOCKS), "--data-parallel-size", "2"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)

        def complete(prompt: list[int]) -> str:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(complete, PROMPTS))
        expected = [o.outputs[0].text for o in offline.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
        assert answers == expected
        # Each engine looked up the prompt tokens of the requests it took; together, all of them.
        queried = [server.metric("vllm:prefix_cache_queries_total", f'engine="{i}"') for i in (0, 1)]
        assert all(queried) and sum(queried) == sum(map(len, PROMPTS))
    finally:
        assert server.stop() == 0
