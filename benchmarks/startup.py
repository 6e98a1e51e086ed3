"""Start-up and the first call: seconds to build ``LLM()`` (load, memory profile, CUDA graphs,
warm-up), then three timed ``generate`` calls of the same short-request mix, each in a fresh
process: once with an empty Triton cache (cold: every kernel variant compiles) and once more
on the same cache (warm: what a restarted server sees). ``LLM()`` is also split by start-up
phase (the worker's ``startup_seconds``: loading, memory profile and KV cache, swap cache,
CUDA graphs, warm-up).

The goal (docs/performance-history.md, "Start-up warm-up"): the first call within 5% of the second,
``LLM()`` within 10 s cold and 4 s warm on the 1B shape. ``--without-warmup-too`` also runs
both with ``warmup=False``, the engine before the warm-up existed. The last column counts the
Triton kernel variants compiled during the calls (0 when the warm-up met every one).

    python benchmarks/startup.py --shape llama-3.2-1b [--without-warmup-too]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, add_out_argument, commit, device_name, now, random_checkpoint, write_result  # noqa: E402

NUM_CALLS = 3


def mixed_workload(num_requests: int, call: int) -> tuple[list[dict], list]:
    """The same request shapes every call, fresh token ids per call (no call hits the cache of
    another): 16-512-token prompts, every other one after one of four shared prefixes (32-500
    tokens: hits within the call), 8-64 output tokens; seeded sampling at temperature 0.8 (a
    third with top-p 0.95), every fourth request greedy with logprobs."""
    from hookllm import SamplingParams

    shape, tokens = random.Random(0), random.Random(call)
    prefixes = [[tokens.randrange(10000) for _ in range(n)] for n in (32, 100, 250, 500)]
    prompts, params = [], []
    for i in range(num_requests):
        prefix = shape.choice(prefixes) if i % 2 else []
        prompts.append({"prompt_token_ids": prefix + [tokens.randrange(10000) for _ in range(shape.randint(16, 512))]})
        max_tokens = shape.randint(8, 64)
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True) if i % 4 == 3
                      else SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95 if i % 3 == 0 else 1.0,
                                          seed=i, ignore_eos=True))
    return prompts, params


def child(checkpoint: str, num_requests: int, warmup: bool) -> None:
    """One fresh process: build the engine, time the calls, print one JSON line."""
    from hookllm import LLM
    from hookllm.kernels import compiled_triton_variants

    start = time.perf_counter()
    llm = LLM(checkpoint, warmup=warmup)
    row = {"llm_s": time.perf_counter() - start, "warmup_s": llm.engine.engine_core.executor.warmup_seconds,
           "phases_s": llm.engine.engine_core.executor.startup_seconds,
           "variants_at_start": compiled_triton_variants(), "calls": []}
    for call in range(1, NUM_CALLS + 1):
        prompts, params = mixed_workload(num_requests, call)
        before, started = compiled_triton_variants(), time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        row["calls"].append({"seconds": time.perf_counter() - started, "compiled": compiled_triton_variants() - before})
    print(json.dumps(row), flush=True)


def run_fresh(checkpoint: Path, cache_dir: str, warmup: bool, num_requests: int) -> dict:
    """``child`` in a new interpreter whose Triton cache is ``cache_dir``."""
    command = [sys.executable, __file__, "--child", str(checkpoint), "--num-requests", str(num_requests)]
    command += [] if warmup else ["--no-warmup"]
    result = subprocess.run(command, env=dict(os.environ, TRITON_CACHE_DIR=cache_dir), stdout=subprocess.PIPE,
                            text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint folder instead of --shape")
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--without-warmup-too", action="store_true", help="also run with warmup=False")
    parser.add_argument("--child", metavar="CHECKPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.num_requests, not args.no_warmup)
        return

    path = args.model or random_checkpoint(args.shape, Path(args.root))
    rows = []
    for warmup in (True, False) if args.without_warmup_too else (True,):
        cache_dir = tempfile.mkdtemp(prefix="hookllm-triton-cache-")
        try:
            for cache in ("cold", "warm"):  # the second process finds the first one's compiled kernels
                row = run_fresh(path, cache_dir, warmup, args.num_requests)
                row.update(warmup=warmup, cache=cache)
                row["first_over_second"] = row["calls"][0]["seconds"] / row["calls"][1]["seconds"]
                rows.append(row)
        finally:
            shutil.rmtree(cache_dir)
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": str(args.model or args.shape),
               "num_requests": args.num_requests, "rows": rows}
    write_result(f"startup-{args.model.name if args.model else args.shape}", payload, args.out)
    print(f"\n{payload['device']} ({payload['commit']}), {payload['model']}, {args.num_requests} requests per call")
    print(f"{'warm-up':<9}{'cache':<7}{'LLM() s':>9}{'warm-up s':>11}"
          + "".join(f"{f'call {i} s':>10}" for i in range(1, NUM_CALLS + 1)) + f"{'1st/2nd':>9}{'compiled':>10}")
    for row in rows:
        warmup_s = f"{row['warmup_s']:.2f}" if row["warmup_s"] is not None else "-"
        calls = "".join(f"{call['seconds']:>10.3f}" for call in row["calls"])
        print(f"{'on' if row['warmup'] else 'off':<9}{row['cache']:<7}{row['llm_s']:>9.2f}{warmup_s:>11}{calls}"
              f"{row['first_over_second']:>9.3f}{sum(call['compiled'] for call in row['calls']):>10}")
    print("LLM() by phase (s; the rest: imports, CUDA and plugin set-up, tokenizer, engine):")
    for row in rows:
        phases = row.get("phases_s", {})
        rest = row["llm_s"] - sum(phases.values())
        print(f"  {'on' if row['warmup'] else 'off'} {row['cache']:<5} "
              + ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items()) + f", rest {rest:.2f}")


if __name__ == "__main__":
    main()
