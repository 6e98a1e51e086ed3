"""A soak run: ``hookllm serve`` on the CPU under randomized load for ``--minutes``, with bad
requests and dropped clients mixed in.

A tiny random Llama (built here) is served by a subprocess on 127.0.0.1 with two API server
processes. ``--clients`` concurrent loops each send, until the time is up, one of: a good
completion or chat request (streamed or not, with random sampling fields, stop strings and
logprobs), a bad request (each must be a 4xx naming the problem), or a stream the client drops
after a few chunks. At the end the server must be idle (no request running, no KV block used)
and still answer. Reports requests served and errors by kind, and the resident memory of the
server's processes at the start (after a warm-up) and at the end.

    python benchmarks/soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import add_out_argument, commit, now, write_result  # noqa: E402
from serve import HOST, free_port, start_server  # noqa: E402

WORDS = "the a cat dog runs jumps over under quick brown fox lazy river stone light dark".split()
# (body fields, expected status, what the error must name): each must be refused, alone.
BAD_REQUESTS = [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": 10**9}, 400, "max_tokens"),
    ({"max_tokens": 2**70}, 400, "max_tokens"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"n": 2}, 400, "n"),
    ({"min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ({"stop": [f"s{i}" for i in range(1000)]}, 400, "stop"),
    ({"prompt": "word " * 5000}, 400, "max"),
    ({"model": "nope"}, 404, "nope"),
]


def text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def good_body(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"model": "soak", "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7, 1.0]),
                  "stream": rng.random() < 0.5, "seed": rng.randint(0, 1000)}
    if rng.random() < 0.3:
        body["top_p"] = 0.9
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text(rng, 1, 200), "logprobs": rng.choice([None, 0, 3])}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text(rng, 1, 100)}]}


async def good_request(client: httpx.AsyncClient, rng: random.Random, counts: Counter) -> None:
    path, body = good_body(rng)
    if body["stream"]:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                counts[f"unexpected {response.status_code} on a good stream"] += 1
                return
            finished = False
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    finished = finished or any(c.get("finish_reason") for c in json.loads(line[6:])["choices"])
            counts["good stream" if finished else "good stream without finish_reason"] += 1
        return
    response = await client.post(path, json=body)
    ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    counts["good request" if ok else f"unexpected {response.status_code} on a good request"] += 1


async def bad_request(client: httpx.AsyncClient, rng: random.Random, counts: Counter) -> None:
    fields, status, named = rng.choice(BAD_REQUESTS)
    body = {"model": "soak", "prompt": text(rng, 1, 20), **fields}
    response = await client.post("/v1/completions", json=body)
    message = response.json().get("error", {}).get("message", "") if response.content else ""
    ok = response.status_code == status and named in message
    counts[f"bad request refused ({named})" if ok else f"bad request answered {response.status_code} ({named})"] += 1


async def dropped_stream(client: httpx.AsyncClient, rng: random.Random, counts: Counter) -> None:
    body = {"model": "soak", "prompt": text(rng, 1, 50), "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        chunks = 0
        async for line in response.aiter_lines():
            chunks += line.startswith("data: ")
            if chunks >= rng.randint(1, 5):
                break  # leaving the block closes the connection mid-stream
    counts["dropped stream"] += 1


async def client_loop(url: str, seed: int, deadline: float, counts: Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            kind = rng.random()
            try:
                if kind < 0.7:
                    await good_request(client, rng, counts)
                elif kind < 0.9:
                    await bad_request(client, rng, counts)
                else:
                    await dropped_stream(client, rng, counts)
            except httpx.HTTPError as exc:
                counts[f"client error {type(exc).__name__}"] += 1


def server_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (Linux ``/proc``), MiB."""
    total, pids = 0, [pid]
    while pids:
        current = pids.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            for task in Path(f"/proc/{current}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
        total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return total / 1024


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name:
            return float(value)
    return 0.0


def tiny_model(root: Path) -> Path:
    from hookllm import testing

    path = root / "soak-llama"
    testing.build_tiny_checkpoint(testing.tiny_llama_config(max_position_embeddings=1024), path)
    testing.build_tiny_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({
        **json.loads((path / "tokenizer_config.json").read_text()),
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"}))
    return path


async def load(url: str, clients: int, seconds: float, counts: Counter) -> None:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(url, seed, deadline, counts) for seed in range(clients)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    add_out_argument(parser)
    args = parser.parse_args()

    model = tiny_model(Path(tempfile.mkdtemp()))
    port = free_port()
    url = f"http://{HOST}:{port}"
    server = start_server(model, port, f"--device cpu --dtype float32 --num-kv-blocks {args.num_kv_blocks} "
                                       "--served-model-name soak --max-model-len 1024", 300, 2)
    counts: Counter = Counter()
    try:
        asyncio.run(load(url, args.clients, 30, Counter()))  # warm-up: allocator and caches settle
        rss_start = server_rss_mib(server.pid)
        start = time.monotonic()
        asyncio.run(load(url, args.clients, args.minutes * 60, counts))
        wall_s = time.monotonic() - start
        idle_deadline = time.monotonic() + 30
        while metric(url, "hookllm:num_requests_running") and time.monotonic() < idle_deadline:
            time.sleep(0.2)
        idle = {name: metric(url, f"hookllm:{name}") for name in ("num_requests_running", "num_used_kv_blocks")}
        rss_end = server_rss_mib(server.pid)
        answers = httpx.post(url + "/v1/completions", json={"model": "soak", "prompt": "the", "max_tokens": 2},
                             timeout=60).status_code == 200
    finally:
        server.terminate()
        exit_status = server.wait(120)
    payload = {"date": now(), "commit": commit(), "minutes": args.minutes, "clients": args.clients,
               "wall_s": wall_s, "counts": dict(sorted(counts.items())), "rss_mib_start": rss_start,
               "rss_mib_end": rss_end, "idle_at_end": idle, "answers_after": answers, "exit_status": exit_status}
    write_result("soak-cpu", payload, args.out)
    for kind, count in sorted(counts.items()):
        print(f"{count:>8}  {kind}")
    print(f"requests: {sum(counts.values())} in {wall_s / 60:.1f} min; server RSS {rss_start:.0f} -> {rss_end:.0f} MiB; "
          f"idle at end: {idle}; answers after: {answers}; exit status {exit_status}")


if __name__ == "__main__":
    main()
