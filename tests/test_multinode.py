"""One engine's ranks on two nodes, on loopback: node 0 runs ``hookllm serve`` with its rank,
node 1 ``hookllm serve --headless`` with the other; the two answer as one process does. A node
that dies, never joins or cannot reach the master ends the engine with an error, and every
process exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from hookllm import LLM, EngineConfig, SamplingParams
from hookllm.worker.multinode import identity_mismatches
from hookllm.worker.multiproc_executor import WorkerError
from server_fixtures import HOST, Server, free_port_pair
from test_server_processes import descendants, leftovers

MAX_TOKENS = 12


def node_args(model, node_rank: int, port: int, *extra: str) -> list[str]:
    return [str(model), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--tensor-parallel-size", "2",
            "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", HOST, "--master-port", str(port),
            "--distributed-timeout", "120", *extra]


def start_headless(model, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "hookllm.entrypoints.cli", "serve", *node_args(model, 1, port, "--headless"),
               "--log-level", "warning"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def two_nodes(tiny_llama_dir):
    """Node 1 (headless) and node 0 (the server), the rendezvous on a free port of loopback."""
    port = free_port_pair()
    headless = start_headless(tiny_llama_dir, port)
    try:
        server = Server([*node_args(tiny_llama_dir, 0, port), "--served-model-name", "tiny"])
    except BaseException:
        headless.kill()
        raise
    yield server, headless
    server.stop()
    headless.wait(30)


def test_nnodes_without_master_addr_is_refused():
    with pytest.raises(ValueError, match="nnodes=2 needs master_addr"):
        EngineConfig(model="unused", tensor_parallel_size=2, nnodes=2)


def test_ranks_that_do_not_split_over_the_nodes_are_refused():
    with pytest.raises(ValueError, match="3 ranks do not split evenly over nnodes=2"):
        EngineConfig(model="unused", tensor_parallel_size=3, nnodes=2, master_addr=HOST)


def test_a_rank_that_disagrees_with_the_engine_is_named_with_each_difference():
    ours = {"model config.json": "ab12", "tensor_parallel_size": 2, "dtype": "float32"}
    theirs = {"model config.json": "cd34", "tensor_parallel_size": 2, "dtype": "bfloat16"}
    assert identity_mismatches(ours, theirs) == ["model config.json 'ab12' here, 'cd34' there",
                                                 "dtype 'float32' here, 'bfloat16' there"]


def test_headless_on_node_0_is_refused(tiny_llama_dir):
    result = subprocess.run([sys.executable, "-m", "hookllm.entrypoints.cli", "serve",
                             *node_args(tiny_llama_dir, 0, free_port_pair(), "--headless")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--headless runs the ranks of a node after node 0" in result.stderr


def test_a_node_that_never_joins_fails_the_engine_within_the_timeout(tiny_llama_dir):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"ranks \[1\] did not join within 3 s"):
        LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=8, tensor_parallel_size=2, nnodes=2,
            master_addr=HOST, master_port=free_port_pair(), distributed_timeout=3)
    assert time.monotonic() - start < 60


def test_a_headless_node_that_cannot_reach_the_master_exits_with_an_error(tiny_llama_dir):
    command = [sys.executable, "-m", "hookllm.entrypoints.cli", "serve",
               *node_args(tiny_llama_dir, 1, free_port_pair(), "--headless"), "--distributed-timeout", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "cannot reach the engine at 127.0.0.1" in result.stdout + result.stderr


def test_two_nodes_answer_as_one_process(two_nodes, tiny_llama_dir):
    server, _ = two_nodes
    prompts = ["the first node", "and the second one", "together"]
    expected = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    for prompt, offline in zip(prompts, expected):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == offline.outputs[0].text


def test_killing_the_headless_node_fails_the_request_in_flight_and_both_nodes_exit(two_nodes):
    server, headless = two_nodes
    processes = [server.process.pid, headless.pid, *descendants(server.process.pid), *descendants(headless.pid)]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "a long story", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as response:
        events = (line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: "))
        assert '"text"' in next(events)  # the request is running
        headless.send_signal(signal.SIGKILL)
        rest = list(events)
    # The stream ends with an error event (naming the lost rank), not a finished choice.
    assert rest[-1] == "[DONE]" and '"error"' in rest[-2] and "rank 1" in rest[-2]
    assert server.process.wait(60) == 1  # the server exits once its engine has died
    deadline = time.monotonic() + 30
    while leftovers(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(processes)
