"""``hookllm serve --api-server-count 2``: two API server processes on one port and one engine
process; the engine's gauges are right before any request, answers equal the offline ``LLM``,
``/metrics`` sums both processes, SIGTERM stops all (also with a stream in flight), leaving no
process behind."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest

from hookllm import LLM, SamplingParams
from server_fixtures import Server

NUM_KV_BLOCKS = 64
NUM_CLIENTS = 24
LONG_STREAM_TOKENS = 480  # near the tiny model's 512 positions: still running when SIGTERM comes


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children + [d for child in children for d in descendants(child)]


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def leftovers(pids: list[int]) -> dict[int, str]:
    """The command line of each of ``pids`` still running."""
    running = {}
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except FileNotFoundError:
            continue
        if is_running(pid):
            running[pid] = cmdline
    return running


def serve_two(tiny_llama_dir: Path, *args: str) -> Server:
    return Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks",
                   str(NUM_KV_BLOCKS), "--served-model-name", "tiny", "--api-server-count", "2", *args])


@pytest.fixture(scope="module")
def two_api_servers(tiny_llama_dir):
    """A fresh server with two API processes: the first test reads it before any request, the next
    one serves its requests and stops it."""
    server = serve_two(tiny_llama_dir)
    yield server
    server.stop()  # nothing more once a test has stopped it


def test_engine_gauges_are_right_before_any_request_with_two_api_servers(two_api_servers):
    for _ in range(8):  # each scrape reaches either API server process
        assert two_api_servers.metric("hookllm:num_kv_blocks") == NUM_KV_BLOCKS
        assert two_api_servers.metric("hookllm:num_requests_running") == 0


def test_two_api_servers_answer_concurrent_streams_sum_their_metrics_and_stop_on_sigterm(two_api_servers, offline):
    prompts = [f"client {i} says" for i in range(NUM_CLIENTS)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params)]
    server = two_api_servers
    try:
        processes = descendants(server.process.pid)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([chunk.choices[0].text async for chunk in stream])

        async def run() -> list[str]:
            async with client:
                return await asyncio.wait_for(asyncio.gather(*[one(p) for p in prompts]), timeout=60)

        assert asyncio.run(run()) == expected
        # Whichever process answers /metrics counts the requests both of them served (a stream's
        # outcome is counted as its handler closes, just after the client has read [DONE]).
        deadline = time.monotonic() + 10
        for _ in range(200):
            if (server.metric("hookllm:request_success_total", 'finished_reason="length"') >= NUM_CLIENTS
                    or time.monotonic() > deadline):
                break
            time.sleep(0.05)
        for _ in range(4):
            assert server.metric("hookllm:request_success_total", 'finished_reason="length"') == NUM_CLIENTS
            assert server.metric("hookllm:generation_tokens_total") == 8 * NUM_CLIENTS
        assert server.metric("hookllm:num_requests_running") == 0
    finally:
        assert server.stop() == 0
    # Two API servers and the engine process (and multiprocessing's resource tracker), all gone.
    assert len(processes) >= 3
    left = leftovers(processes)
    assert not left, f"still running after hookllm serve exited: {left}"


def test_sigterm_with_a_long_stream_in_flight_exits_0_and_leaves_no_process(tiny_llama_dir):
    server = serve_two(tiny_llama_dir, "--shutdown-timeout", "1")
    processes = descendants(server.process.pid)
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": LONG_STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            first_line = next(response.iter_lines())  # the request runs: its first event came
            status = server.stop()
    finally:
        server.stop()  # nothing more once it has exited
    assert first_line.startswith("data: {")
    assert status == 0
    assert len(processes) >= 3
    left = leftovers(processes)
    assert not left, f"still running after hookllm serve exited: {left}"
