"""Online serving: ``hookllm serve`` in a subprocess, workload A as streaming requests over loopback.

Workload A (see throughput.py) is sent with token-id prompts through ``/v1/completions``
(``ignore_eos``, temperature 0.6), first all at once ("full concurrency"), then by a Poisson
process at each ``--rates`` req/s, by ``--client-processes`` aiohttp clients. Per run: output
tok/s, TTFT and TPOT p50/p99, and the CPU seconds the server's API processes and its engine
process spent (Linux ``/proc``; an API process near one CPU second per second is saturated: its
event loop is the limit, and ``--api-server-count N`` runs N of them). Then the same requests through offline ``LLM.generate`` in this
process, for the served / offline ratio.

    python benchmarks/serve.py --shape llama-3.2-1b --rates 20,40
    # CPU smoke test on a small checkpoint:
    python benchmarks/serve.py --model DIR --num-requests 8 --max-len 32 --rates 4 \\
        --engine-args "--device cpu --dtype float32 --num-kv-blocks 64"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, add_out_argument, commit, device_name, now, random_checkpoint, write_result  # noqa: E402
from throughput import workload_a  # noqa: E402

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def start_server(model: Path, port: int, engine_args: str, startup_s: float, api_servers: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "hookllm.entrypoints.cli", "serve", str(model), "--host", HOST, "--port", str(port),
               "--served-model-name", "bench", "--log-level", "warning", "--api-server-count", str(api_servers),
               *shlex.split(engine_args)]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"hookllm serve exited with {process.returncode}")
        try:
            if httpx.get(f"http://{HOST}:{port}/health", timeout=1.0).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError(f"hookllm serve was not healthy within {startup_s} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds of the API server processes (the server's own process, or with
    --api-server-count its children named hookllm-api) and of the engine process (hookllm-engine)."""
    children = [int(pid) for pid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()]
    names = {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in children}
    api = [pid for pid in children if names[pid] == "hookllm-api"] or [server_pid]
    return {"api": sum(cpu_seconds(pid) for pid in api),
            "engine": sum(cpu_seconds(pid) for pid in children if names[pid] == "hookllm-engine")}


async def one_request(http: "aiohttp.ClientSession", url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: its send time, first and last chunk times (wall clock) and token count."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.time()
    first = last = None
    tokens = 0
    async with http.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"]:
                last = time.time()
                first = first or last
    return {"sent": sent, "first": first, "last": last, "tokens": tokens}


async def send_all(url: str, jobs: list[tuple[float, list[int], int]], start_at: float) -> list[dict]:
    """Send each (offset, prompt, max_tokens) at ``start_at + offset`` (wall clock)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        tasks = []
        for offset, prompt, max_tokens in jobs:
            await asyncio.sleep(max(0.0, start_at + offset - time.time()))
            tasks.append(asyncio.create_task(one_request(http, url, prompt, max_tokens)))
        return await asyncio.gather(*tasks)


def client_process(url: str, jobs: list, ready: "multiprocessing.Queue", start_at: "multiprocessing.Queue",
                   results: "multiprocessing.Queue") -> None:
    import aiohttp  # noqa: F401 - imported before saying ready, not on the clock

    ready.put(None)
    results.put(asyncio.run(send_all(url, jobs, start_at.get())))


def run_load(url: str, prompts, max_tokens, rate: float | None, num_clients: int, server_pid: int) -> dict:
    """All requests at once (``rate`` None) or with Poisson arrivals at ``rate`` req/s, sent by
    ``num_clients`` processes (one Python client cannot parse tens of thousands of events a second)."""
    gaps = np.random.default_rng(0).exponential(1.0 / rate, len(prompts)) if rate else np.zeros(len(prompts))
    offsets = np.cumsum(gaps)
    jobs = [(float(t), p, n) for t, p, n in zip(offsets, prompts, max_tokens)]
    context = multiprocessing.get_context("spawn")
    ready, start, queue = context.Queue(), context.Queue(), context.Queue()
    clients = [context.Process(target=client_process, args=(url, jobs[i::num_clients], ready, start, queue))
               for i in range(num_clients)]
    for client in clients:
        client.start()
    for _ in clients:  # the clock starts once every client has started up
        ready.get()
    start_at = time.time() + 0.1
    cpu_before = server_cpu_seconds(server_pid)
    for _ in clients:
        start.put(start_at)
    results = [r for _ in clients for r in queue.get()]
    cpu = {k: v - cpu_before[k] for k, v in server_cpu_seconds(server_pid).items()}
    for client in clients:
        client.join()
    seconds = max(r["last"] for r in results) - start_at
    ttft = np.asarray([r["first"] - r["sent"] for r in results])
    tpot = np.asarray([(r["last"] - r["first"]) / max(1, r["tokens"] - 1) for r in results])
    output_tokens = sum(r["tokens"] for r in results)
    return {"rate_req_s": rate or "max", "num_requests": len(prompts), "client_processes": num_clients,
            "wall_s": seconds, "output_tok_s": output_tokens / seconds, "output_tokens": output_tokens,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)), "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)),
            "api_cpu_s": cpu["api"], "engine_cpu_s": cpu["engine"],
            "api_cpu_us_per_token": 1e6 * cpu["api"] / max(1, output_tokens)}


def run_offline(model: Path, prompts, max_tokens, engine_args: str) -> dict:
    """The same requests through ``LLM.generate``, with the server's engine flags."""
    import dataclasses

    from hookllm import LLM, SamplingParams
    from hookllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_args(["--model", str(model), *shlex.split(engine_args)]))
    llm = LLM(**dataclasses.asdict(config.create_engine_config()))
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8))  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": seconds, "output_tok_s": output_tokens / seconds, "output_tokens": output_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint folder instead of --shape")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=None, help="cut prompts and max_tokens to this (smoke tests)")
    parser.add_argument("--rates", default="20", help="comma-separated Poisson rates in req/s ('' for none)")
    parser.add_argument("--engine-args", default="--max-model-len 2112",
                        help="engine flags for the server and the offline run, as one string")
    parser.add_argument("--startup-s", type=float, default=600.0)
    parser.add_argument("--client-processes", type=int, default=4, help="processes sending the requests")
    parser.add_argument("--api-server-count", type=int, default=1, help="the server's API processes")
    add_out_argument(parser)
    args = parser.parse_args()

    model = args.model or random_checkpoint(args.shape, Path(args.root))
    prompts, max_tokens = workload_a(args.num_requests)
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 10001)
    prompts = [[t % vocab for t in p[:args.max_len]] for p in prompts]  # a small model's vocabulary
    max_tokens = [min(n, args.max_len or n) for n in max_tokens]
    rates = [float(r) for r in args.rates.split(",") if r]
    name = f"serve-{args.model.name if args.model else args.shape}"
    results: dict[str, dict] = {}
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": str(model),
               "workload": f"A over HTTP: {args.num_requests} streamed requests, token-id prompts, ignore_eos"
                           + (f", cut to {args.max_len} tokens" if args.max_len else ""),
               "engine_args": args.engine_args, "api_server_count": args.api_server_count, "results": results}

    port = free_port()
    server = start_server(model, port, args.engine_args, args.startup_s, args.api_server_count)
    try:
        url = f"http://{HOST}:{port}"
        run_load(url, prompts[:2], [4, 4], None, 1, server.pid)  # warm-up
        for rate in [None, *rates]:
            key = "full_concurrency" if rate is None else f"rate_{rate:g}"
            results[key] = run_load(url, prompts, max_tokens, rate, args.client_processes, server.pid)
    finally:
        server.terminate()
        server.wait(60)
    results["offline"] = run_offline(model, prompts, max_tokens, args.engine_args)
    for row in results.values():
        row["vs_offline"] = row["output_tok_s"] / results["offline"]["output_tok_s"]
    write_result(name, payload, args.out)
    print(f"{'run':<18}{'out tok/s':>11}{'x offline':>11}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>9}  (ms)"
          f"{'API CPU/s':>11}{'engine CPU/s':>14}{'API us/token':>14}")
    for key, row in results.items():
        served = "ttft_p50_ms" in row
        latency = "".join(f"{row[k]:>{w}.1f}" for k, w in (("ttft_p50_ms", 10), ("ttft_p99_ms", 9),
                                                            ("tpot_p50_ms", 10), ("tpot_p99_ms", 9))) if served else ""
        cpu = (f"{'':7}{row['api_cpu_s'] / row['wall_s']:>11.2f}{row['engine_cpu_s'] / row['wall_s']:>14.2f}"
               f"{row['api_cpu_us_per_token']:>14.1f}") if served else ""
        print(f"{key:<18}{row['output_tok_s']:>11.0f}{row['vs_offline']:>11.2f}{latency}{cpu}")


if __name__ == "__main__":
    main()
