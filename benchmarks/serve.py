"""Online serving: ``hookllm serve`` in a subprocess, workload A as streaming requests over loopback.

Workload A (see throughput.py) is sent with token-id prompts through ``/v1/completions``
(``ignore_eos``, temperature 0.6), first all at once ("full concurrency"), then by a Poisson
process at each ``--rates`` req/s, by ``--client-processes`` aiohttp clients. Per run: output
tok/s, TTFT and TPOT p50/p99, and the CPU seconds the server's API processes and its engine
process spent (Linux ``/proc``; an API process near one CPU second per second is saturated: its
event loop is the limit, and ``--api-server-count N`` runs N of them). Then the same requests through offline ``LLM.generate`` in this
process, for the served / offline ratio.

``--grpc`` starts the server with ``--grpc-port`` too and runs each load a second time over gRPC
(vLLM's engine service: the same token-id prompts and sampling, ``stream=true``), so HTTP, gRPC
and offline are measured in one run (rows ``*_grpc``).

``--tools-fraction F`` runs each load a second time with an evenly spread fraction ``F`` of the
requests sent as chat requests that carry ``TOOLS`` and ``tool_choice: "required"`` (their output
constrained by the ``structured`` plugin, which the server is started with): the served
throughput with tool requests beside the plain one. A tool request's message is its prompt's
token ids decoded (less the template's and the tools' share, so the rendered prompt keeps about
the prompt's length), with the same ``max_tokens`` and ``ignore_eos``. That needs a tokenizer:
``--shape`` runs use structured.py's checkpoint (the random weights linked, a trained BPE).

    python benchmarks/serve.py --shape llama-3.2-1b --rates 20,40
    python benchmarks/serve.py --shape llama-3.2-1b --rates 20 --tools-fraction 0.25
    python benchmarks/serve.py --shape llama-3.2-1b --rates 20 --grpc
    # CPU smoke test on a small checkpoint (with a tokenizer, for --tools-fraction):
    python benchmarks/serve.py --model DIR --num-requests 8 --max-len 32 --rates 4 --tools-fraction 0.25 \\
        --engine-args "--device cpu --dtype float32 --num-kv-blocks 64"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, add_out_argument, commit, device_name, now, random_checkpoint, write_result  # noqa: E402
from throughput import workload_a  # noqa: E402

HOST = "127.0.0.1"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GRPC = "grpc"  # a job's "path" for a gRPC Generate call (its body: a completions body)
STRUCTURED_TOKENIZER_VOCAB = 32000  # structured.py's default --tokenizer-vocab: its checkpoint folder is reused
# Two functions a travel assistant might offer, with the JSON-schema parameters clients send. Every
# value is bounded, so even random weights complete a call (then, with ignore_eos, only EOS follows).
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 64, "description": "the city's name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a day.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "departure airport (IATA code)"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "arrival airport (IATA code)"},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "max_stops": {"type": "integer", "minimum": 0, "maximum": 3}},
            "required": ["origin", "destination", "date"], "additionalProperties": False}}},
]
# For a tokenizer without a chat template (the benchmarks' random checkpoints): the tools as JSON.
TOOLS_TEMPLATE = ("{% if tools %}<|system|>You may call these functions: {{ tools | tojson }}\n{% endif %}"
                  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def start_server(model: Path, port: int, engine_args: list[str], startup_s: float,
                 api_servers: int, grpc_port: int | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "hookllm.entrypoints.cli", "serve", str(model), "--host", HOST, "--port", str(port),
               "--served-model-name", "bench", "--log-level", "warning", "--api-server-count", str(api_servers),
               *(["--grpc-port", str(grpc_port)] if grpc_port else []), *engine_args]
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


def is_tool_request(index: int, tools_fraction: float) -> bool:
    """Whether request ``index`` is one of an evenly spread ``tools_fraction`` of the requests."""
    return math.floor((index + 1) * tools_fraction) > math.floor(index * tools_fraction)


def build_requests(prompts: list[list[int]], max_tokens: list[int], tools_fraction: float = 0.0,
                   tokenizer=None) -> list[tuple[str, dict]]:
    """Workload A as streamed requests, each (path, body): completions of the token-id prompts,
    but for ``tools_fraction`` of them chat requests with ``TOOLS`` and ``tool_choice: "required"``
    whose rendered prompt has about the prompt's length (``tokenizer`` decodes and renders them)."""
    template = None if tools_fraction == 0 or tokenizer.chat_template else TOOLS_TEMPLATE
    overhead = len(chat_prompt_ids(tokenizer, "", template)) if tools_fraction else 0
    requests = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        common = {"model": "bench", "max_tokens": n, "temperature": 0.6, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}
        if not is_tool_request(i, tools_fraction):
            requests.append((COMPLETIONS, {**common, "prompt": prompt}))
            continue
        message = message_text(tokenizer, prompt, len(prompt) - overhead)
        body = {**common, "messages": [{"role": "user", "content": message}], "tools": TOOLS,
                "tool_choice": "required"}
        requests.append((CHAT, {**body, "chat_template": template} if template else body))
    return requests


def message_text(tokenizer, ids: list[int], budget: int) -> str:
    """A text of at most ``budget`` tokens made of ``ids``' first ones, decoded. Decoded ids need
    not encode back to as many (bytes of a broken character, merges across their joins), so the
    cut shrinks until the text's own encoding fits."""
    cut = budget = max(0, budget)
    text = tokenizer.decode(ids[:cut])
    while (length := len(tokenizer(text, add_special_tokens=False)["input_ids"])) > budget:
        cut = min(cut - 1, cut * budget // length)
        text = tokenizer.decode(ids[:cut])
    return text


def chat_prompt_ids(tokenizer, message: str, template: str | None) -> list[int]:
    """The token ids of a tool request's prompt: ``message`` with ``TOOLS``, through ``template``
    (None: the tokenizer's own), as the server renders it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tools=TOOLS,
                                         chat_template=template, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def one_request(http: "aiohttp.ClientSession", url: str, path: str, body: dict) -> dict:
    """One streamed request: its send time, first and last chunk times (wall clock), token count,
    and whether its reply streamed tool calls."""
    sent = time.time()
    first = last = None
    tokens = 0
    tool_calls = False
    async with http.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{path} failed while streaming: {event['error']['message']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"]:
                last = time.time()
                first = first or last
                tool_calls = tool_calls or bool(event["choices"][0].get("delta", {}).get("tool_calls"))
    return {"sent": sent, "first": first, "last": last, "tokens": tokens, "tool_calls": tool_calls}


async def one_grpc_request(stub: Any, body: dict) -> dict:
    """One streamed gRPC Generate call of a completions ``body``, timed as :func:`one_request`."""
    from hookllm.grpc_client import generate_request

    request = generate_request(body["prompt"], stream=True, max_tokens=body["max_tokens"],
                               temperature=body["temperature"], ignore_eos=body["ignore_eos"])
    sent = time.time()
    first = last = None
    tokens = 0
    async for response in stub.Generate(request):
        if response.chunk.token_ids:
            last = time.time()
            first = first or last
        if response.HasField("complete"):
            tokens = response.complete.completion_tokens
    return {"sent": sent, "first": first, "last": last, "tokens": tokens, "tool_calls": False}


async def send_all(url: str, jobs: list[tuple[float, str, dict]], start_at: float,
                   grpc_target: str | None = None) -> list[dict]:
    """Send each (offset, path, body) at ``start_at + offset`` (wall clock): over HTTP, or over
    one gRPC channel to ``grpc_target`` for the ``GRPC`` jobs."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    channel = stub = None
    if grpc_target is not None:
        import grpc

        from hookllm.grpc import vllm_engine_pb2_grpc

        channel = grpc.aio.insecure_channel(grpc_target)
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
            tasks = []
            for offset, path, body in jobs:
                await asyncio.sleep(max(0.0, start_at + offset - time.time()))
                call = one_grpc_request(stub, body) if path == GRPC else one_request(http, url, path, body)
                tasks.append(asyncio.create_task(call))
            return await asyncio.gather(*tasks)
    finally:
        if channel is not None:
            await channel.close()


def client_process(url: str, jobs: list, ready: "multiprocessing.Queue", start_at: "multiprocessing.Queue",
                   results: "multiprocessing.Queue", grpc_target: str | None) -> None:
    import aiohttp  # noqa: F401 - imported before saying ready, not on the clock

    ready.put(None)
    results.put(asyncio.run(send_all(url, jobs, start_at.get(), grpc_target)))


def run_load(url: str, requests: list[tuple[str, dict]], rate: float | None, num_clients: int,
             server_pid: int, grpc_target: str | None = None) -> dict:
    """All ``requests`` (path, body) at once (``rate`` None) or with Poisson arrivals at ``rate`` req/s, sent by
    ``num_clients`` processes (one Python client cannot parse tens of thousands of events a second)."""
    gaps = np.random.default_rng(0).exponential(1.0 / rate, len(requests)) if rate else np.zeros(len(requests))
    offsets = np.cumsum(gaps)
    jobs = [(float(t), path, body) for t, (path, body) in zip(offsets, requests)]
    context = multiprocessing.get_context("spawn")
    ready, start, queue = context.Queue(), context.Queue(), context.Queue()
    clients = [context.Process(target=client_process, args=(url, jobs[i::num_clients], ready, start, queue,
                                                                    grpc_target))
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
    tool_requests = sum(path == CHAT for path, _ in requests)
    tools = {"tool_requests": tool_requests, "tool_call_replies": sum(r["tool_calls"] for r in results)}
    return {"rate_req_s": rate or "max", "num_requests": len(requests), "client_processes": num_clients,
            "wall_s": seconds, "output_tok_s": output_tokens / seconds, "output_tokens": output_tokens,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)), "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)),
            "api_cpu_s": cpu["api"], "engine_cpu_s": cpu["engine"],
            "api_cpu_us_per_token": 1e6 * cpu["api"] / max(1, output_tokens), **(tools if tool_requests else {})}


def run_offline(model: Path, prompts, max_tokens, engine_args: list[str]) -> dict:
    """The same requests through ``LLM.generate``, with the server's engine flags."""
    import dataclasses

    from hookllm import LLM, SamplingParams
    from hookllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_args(["--model", str(model), *engine_args]))
    llm = LLM(**dataclasses.asdict(config.create_engine_config()))
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8))  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": seconds, "output_tok_s": output_tokens / seconds, "output_tokens": output_tokens}


def checkpoint(args: argparse.Namespace) -> Path:
    """``--model``, else ``--shape``'s random checkpoint: with tool requests, structured.py's copy of
    it that has a tokenizer (the weights linked, the same folder structured.py uses)."""
    if args.model:
        return args.model
    if not args.tools_fraction:
        return random_checkpoint(args.shape, Path(args.root))
    from structured import checkpoint_with_tokenizer

    return checkpoint_with_tokenizer(argparse.Namespace(tiny=False, shape=args.shape, root=args.root,
                                                        tokenizer_vocab=STRUCTURED_TOKENIZER_VOCAB))


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
    parser.add_argument("--tools-fraction", type=float, default=0.0,
                        help="also run each load with this fraction of the requests as chat requests with tools "
                             "and tool_choice 'required' (0: none)")
    parser.add_argument("--grpc", action="store_true",
                        help="also run each load over gRPC (the server's --grpc-port): rows *_grpc")
    add_out_argument(parser)
    args = parser.parse_args()
    if not 0.0 <= args.tools_fraction <= 1.0:
        parser.error(f"--tools-fraction must be in [0, 1], got {args.tools_fraction}")

    model = checkpoint(args)
    engine_args = shlex.split(args.engine_args)
    server_args = engine_args
    tokenizer = None
    if args.tools_fraction:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        if "structured" not in engine_args:  # it constrains the tool requests' output
            server_args = [*engine_args, "--plugin", "structured"]
    prompts, max_tokens = workload_a(args.num_requests)
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 10001)
    prompts = [[t % vocab for t in p[:args.max_len]] for p in prompts]  # a small model's vocabulary
    max_tokens = [min(n, args.max_len or n) for n in max_tokens]
    rates = [float(r) for r in args.rates.split(",") if r]
    name = f"serve-{args.model.name if args.model else args.shape}" + ("-tools" if args.tools_fraction else "")
    results: dict[str, dict] = {}
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": str(model),
               "workload": f"A over HTTP{' and gRPC' if args.grpc else ''}: {args.num_requests} streamed requests, token-id prompts, ignore_eos"
                           + (f", cut to {args.max_len} tokens" if args.max_len else "")
                           + (f"; rows *_tools: {args.tools_fraction:g} of them chat requests with tools and "
                              "tool_choice 'required'" if args.tools_fraction else ""),
               "engine_args": " ".join(server_args), "api_server_count": args.api_server_count,
               "tools_fraction": args.tools_fraction, "results": results}
    loads = {"": build_requests(prompts, max_tokens)}
    if args.tools_fraction:
        loads["_tools"] = build_requests(prompts, max_tokens, args.tools_fraction, tokenizer)
    if args.grpc:
        loads["_grpc"] = [(GRPC, body) for _, body in loads[""]]

    port = free_port()
    grpc_port = free_port() if args.grpc else None
    grpc_target = f"{HOST}:{grpc_port}" if args.grpc else None
    server = start_server(model, port, server_args, args.startup_s, args.api_server_count, grpc_port)
    try:
        url = f"http://{HOST}:{port}"
        # Warm-up: with tools, one tool request too (its grammar's first compile is not on the clock).
        warm_up = build_requests(prompts[:2], [4, 4], 0.5 if args.tools_fraction else 0.0, tokenizer)
        if args.grpc:
            warm_up += [(GRPC, body) for _, body in warm_up]
        run_load(url, warm_up, None, 1, server.pid, grpc_target)
        for rate in [None, *rates]:
            for suffix, requests in loads.items():
                key = ("full_concurrency" if rate is None else f"rate_{rate:g}") + suffix
                results[key] = run_load(url, requests, rate, args.client_processes, server.pid, grpc_target)
    finally:
        server.terminate()
        server.wait(60)
    results["offline"] = run_offline(model, prompts, max_tokens, engine_args)
    for row in results.values():
        row["vs_offline"] = row["output_tok_s"] / results["offline"]["output_tok_s"]
    write_result(name, payload, args.out)
    print(f"{'run':<24}{'out tok/s':>11}{'x offline':>11}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>9}  (ms)"
          f"{'API CPU/s':>11}{'engine CPU/s':>14}{'API us/token':>14}")
    for key, row in results.items():
        served = "ttft_p50_ms" in row
        latency = "".join(f"{row[k]:>{w}.1f}" for k, w in (("ttft_p50_ms", 10), ("ttft_p99_ms", 9),
                                                            ("tpot_p50_ms", 10), ("tpot_p99_ms", 9))) if served else ""
        cpu = (f"{'':7}{row['api_cpu_s'] / row['wall_s']:>11.2f}{row['engine_cpu_s'] / row['wall_s']:>14.2f}"
               f"{row['api_cpu_us_per_token']:>14.1f}") if served else ""
        tools = f"  tool calls in {row['tool_call_replies']}/{row['tool_requests']}" if "tool_requests" in row else ""
        print(f"{key:<24}{row['output_tok_s']:>11.0f}{row['vs_offline']:>11.2f}{latency}{cpu}{tools}")


if __name__ == "__main__":
    main()
