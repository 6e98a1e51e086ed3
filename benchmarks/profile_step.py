"""Where a decode step's time goes: host work versus GPU kernels (run on the GPU machine).

Fills the engine with workload A's requests, runs until every request is decoding, then
profiles N decode steps with torch.profiler: wall time per step, GPU busy time per step
(sum of kernel times), the host time spent in each part of the step, and the top kernels.

    python benchmarks/profile_step.py --shape llama-3.2-1b --steps 30
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, commit, device_name, now, random_checkpoint, write_result  # noqa: E402
from throughput import workload_a  # noqa: E402

# Host-side parts of LLMEngine.step, timed by wrapping these methods.
PARTS = {
    "schedule": ("scheduler", "schedule"),
    "build_inputs": ("worker.runner", "build_inputs"),
    "forward (launch or replay)": ("worker.runner", "forward"),
    "sample hook": ("hooks", "call_first"),
}


def _resolve(root, dotted):
    for attr in dotted.split("."):
        root = getattr(root, attr)
    return root


def instrument(engine, totals):
    """Wrap each part's method with a host timer accumulating into ``totals``."""
    for name, (owner, method) in PARTS.items():
        target = _resolve(engine, owner)
        original = getattr(target, method)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(target, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    from hookllm import LLM, SamplingParams

    path = random_checkpoint(args.shape, Path(args.root))
    llm = LLM(str(path), max_model_len=2048 + 64, max_num_seqs=256, max_num_batched_tokens=8192)
    engine = llm.engine
    prompts, _ = workload_a(args.num_requests)
    for prompt in prompts:
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1000, output_kind="final_only"))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()  # warm the decode path
    totals: dict[str, float] = defaultdict(float)
    instrument(engine, totals)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu_total = sum(e.self_device_time_total for e in kernels) / 1e6
    batch = len(engine.scheduler.running)
    rows = {"wall_ms_per_step": 1e3 * wall / args.steps, "gpu_busy_ms_per_step": 1e3 * gpu_total / args.steps,
            "batch": batch, **{f"host_ms_{k}": 1e3 * v / args.steps for k, v in totals.items()}}
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": args.shape, "per_step": rows,
               "top_kernels_us_per_step": {e.key[:80]: e.self_device_time_total / args.steps for e in top}}
    write_result(f"profile-{args.shape}", payload)
    print(f"\n{args.shape}, {batch} running requests, {args.steps} decode steps ({payload['commit']})")
    for key, value in rows.items():
        print(f"  {key:<40}{value:>10.2f}")
    print("  top kernels (us per step):")
    for name, us in payload["top_kernels_us_per_step"].items():
        print(f"    {us:>9.1f}  {name}")


if __name__ == "__main__":
    main()
