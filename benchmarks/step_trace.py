"""Where a whole workload's time goes, step by step (needs a CUDA GPU).

Runs a workload of throughput.py (``--workload short`` by default) through ``LLMEngine.step``
and records each step's wall time with what it held: decode rows, prefill tokens, requests
admitted and finished, and garbage-collector pauses. Steps are grouped into decode-only steps
(CUDA-graph replays up to the largest captured batch) and steps with prefill (run eagerly, or
as CUDA graphs with ``--max-cuda-graph-tokens``);
the table shows each group's share of the wall time, the step-time percentiles and the
outliers, so a slow or uneven run points at its cause.

With ``--profile``, one more run goes under torch.profiler with host timers around each part of
the step (``profile_step.py``'s): it prints the GPU busy time against the wall time (a GPU
busy far below the wall means the host is the limit), the top kernels, and the host time by part.

    python benchmarks/step_trace.py --shape llama-3.2-1b --workload short [--profile]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import (SHAPES, add_out_argument, commit, device_name, instrument, kernel_times, now,  # noqa: E402
                    random_checkpoint, write_result)
from throughput import WORKLOADS, random_workload  # noqa: E402


def trace(engine, prompts, max_tokens) -> list[dict]:
    """Every step of one run of the workload: its seconds, its batch and the GC time inside it."""
    from hookllm import SamplingParams

    gc_seconds = [0.0]
    gc_started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_started[0]

    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"trace-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    steps = []
    gc.callbacks.append(on_gc)
    try:
        while engine.has_unfinished_requests():
            gc_seconds[0] = 0.0
            waiting_before = len(engine.engine_core.scheduler.waiting)
            start = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - start
            batch = engine.engine_core.in_flight[-1][0] if engine.engine_core.in_flight else None
            counts = batch.num_scheduled_tokens if batch is not None else []
            steps.append({"s": seconds, "gc_s": gc_seconds[0], "rows": len(counts),
                          "prefill_tokens": sum(c for c in counts if c > 1),
                          "admitted": waiting_before - len(engine.engine_core.scheduler.waiting),
                          "finished": sum(o.finished for o in outputs)})
    finally:
        gc.callbacks.remove(on_gc)
    return steps


def summarize(steps: list[dict], output_tokens: int) -> dict:
    seconds = np.asarray([s["s"] for s in steps])
    mixed = np.asarray([s["prefill_tokens"] > 0 for s in steps])
    median = float(np.median(seconds))
    outliers = [s for s in steps if s["s"] > 3 * median]
    groups = {}
    for name, mask in (("decode-only steps", ~mixed), ("steps with prefill", mixed)):
        if mask.any():
            group = [s for s, m in zip(steps, mask) if m]
            groups[name] = {"steps": int(mask.sum()), "seconds": float(seconds[mask].sum()),
                            "mean_ms": 1e3 * float(seconds[mask].mean()),
                            "mean_rows": float(np.mean([s["rows"] for s in group])),
                            "mean_prefill_tokens": float(np.mean([s["prefill_tokens"] for s in group]))}
    return {"wall_s": float(seconds.sum()), "output_tok_s": output_tokens / float(seconds.sum()),
            "steps": len(steps), "step_ms_p50": 1e3 * median,
            "step_ms_p99": 1e3 * float(np.percentile(seconds, 99)), "step_ms_max": 1e3 * float(seconds.max()),
            "gc_s": float(sum(s["gc_s"] for s in steps)), "groups": groups,
            "outliers": {"count": len(outliers), "seconds": float(sum(s["s"] for s in outliers)),
                         "gc_s": float(sum(s["gc_s"] for s in outliers)),
                         "with_prefill": sum(s["prefill_tokens"] > 0 for s in outliers)}}


def profiled(engine, prompts, max_tokens) -> dict:
    """One run under torch.profiler, with host timers: GPU busy versus wall time, top kernels,
    host time by part of the step (seconds over the whole run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from profile_step import PARTS

    totals: dict[str, float] = defaultdict(float)
    instrument(engine, PARTS, totals)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = trace(engine, prompts, max_tokens)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kernels = kernel_times(prof)
    return {"wall_s": wall, "steps": len(steps),
            "gpu_busy_s": sum(seconds for _, seconds in kernels),
            "top_kernels_s": {name[:90]: seconds for name, seconds in kernels[:12]},
            "host_s_by_part": dict(totals)}


def main() -> None:
    from hookllm.config import EngineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--workload", default="short", choices=sorted(WORKLOADS))
    parser.add_argument("--runs", type=int, default=3, help="traced runs on one engine (prefix cache reset)")
    parser.add_argument("--profile", action="store_true", help="one more run under torch.profiler")
    parser.add_argument("--max-cuda-graph-tokens", type=int, default=EngineConfig.max_cuda_graph_tokens,
                        help="the engine option: steps with prefill up to this many tokens as CUDA graphs "
                             "(0: eagerly; default: the engine's)")
    add_out_argument(parser)
    args = parser.parse_args()

    from hookllm import LLM, SamplingParams

    path = random_checkpoint(args.shape, Path(args.root))
    llm = LLM(str(path), max_model_len=2048 + 64, max_cuda_graph_tokens=args.max_cuda_graph_tokens)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8), use_tqdm=False)
    prompts, max_tokens = random_workload(args.workload)
    runs = []
    for _ in range(args.runs):
        llm.reset_prefix_cache()
        runs.append(summarize(trace(llm.engine, prompts, max_tokens), sum(max_tokens)))
    payload = {"device": device_name(), "date": now(), "commit": commit(), "shape": args.shape,
               "workload": args.workload, "max_cuda_graph_tokens": args.max_cuda_graph_tokens, "runs": runs}
    if args.profile:
        llm.reset_prefix_cache()
        payload["profile"] = profiled(llm.engine, prompts, max_tokens)
    write_result(f"step-trace-{args.shape}-{args.workload}", payload, args.out)
    print(f"{args.shape}, workload {args.workload}, {device_name()} ({commit()})")
    print(f"{'run':<4}{'tok/s':>8}{'steps':>7}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'GC s':>7}"
          f"{'decode s (n, ms)':>22}{'prefill s (n, ms, tok)':>30}{'outliers n/s/gc':>18}")
    for i, run in enumerate(runs):
        d = run["groups"].get("decode-only steps", {"seconds": 0, "steps": 0, "mean_ms": 0})
        p = run["groups"].get("steps with prefill", {"seconds": 0, "steps": 0, "mean_ms": 0, "mean_prefill_tokens": 0})
        o = run["outliers"]
        print(f"{i:<4}{run['output_tok_s']:>8.0f}{run['steps']:>7}{run['step_ms_p50']:>8.2f}{run['step_ms_p99']:>8.2f}"
              f"{run['step_ms_max']:>8.1f}{run['gc_s']:>7.2f}"
              f"{d['seconds']:>9.2f} ({d['steps']:>5}, {d['mean_ms']:.2f})"
              f"{p['seconds']:>9.2f} ({p['steps']:>5}, {p['mean_ms']:.2f}, {p['mean_prefill_tokens']:.0f})"
              f"{o['count']:>6}/{o['seconds']:.2f}/{o['gc_s']:.2f}")
    if args.profile:
        p = payload["profile"]
        print(f"profiled run: wall {p['wall_s']:.2f} s, GPU busy {p['gpu_busy_s']:.2f} s, {p['steps']} steps")
        for name, seconds in p["top_kernels_s"].items():
            print(f"  {seconds:>7.3f} s  {name}")
        for name, seconds in p["host_s_by_part"].items():
            print(f"  host {seconds:>7.3f} s  {name}")


if __name__ == "__main__":
    main()
