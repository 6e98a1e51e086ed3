"""``hookllm serve --api-server-count 2``: two API server processes on one port and one engine
process; answers equal the offline ``LLM``, ``/metrics`` sums both processes, SIGTERM stops all."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest

from hookllm import LLM, SamplingParams
from server_fixtures import Server

NUM_KV_BLOCKS = 64
NUM_CLIENTS = 24


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


def test_two_api_servers_answer_concurrent_streams_sum_their_metrics_and_stop_on_sigterm(tiny_llama_dir, offline):
    prompts = [f"client {i} says" for i in range(NUM_CLIENTS)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params)]
    server = Server([str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks",
                     str(NUM_KV_BLOCKS), "--served-model-name", "tiny", "--api-server-count", "2"])
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
        while (server.metric("hookllm:request_success_total", 'finished_reason="length"') < NUM_CLIENTS
               and time.monotonic() < deadline):
            time.sleep(0.05)
        for _ in range(4):
            assert server.metric("hookllm:request_success_total", 'finished_reason="length"') == NUM_CLIENTS
            assert server.metric("hookllm:generation_tokens_total") == 8 * NUM_CLIENTS
        assert server.metric("hookllm:num_requests_running") == 0
    finally:
        assert server.stop() == 0
    # Two API servers and the engine process (and multiprocessing's resource tracker), all gone.
    assert len(processes) >= 3
    assert not [pid for pid in processes if is_running(pid)]
