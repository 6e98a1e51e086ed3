"""Where a decode step's time goes: host work versus GPU kernels (needs a CUDA GPU).

Fills the engine with workload A's requests, runs until every request is decoding, then times
N decode steps three times: plain (wall time per step), with host timers around each part of
the step, and under torch.profiler (GPU busy time per step = sum of kernel times, top kernels).

    python benchmarks/profile_step.py --shape llama-3.2-1b --steps 30 [--sync] [--top-p 0.9 --top-k 50 ...]
        [--lora-adapters 8 --lora-rank 16]

Sampling options are throughput.py's (temperature 0.6 plus the ones given). With
``--lora-adapters N``, the engine serves random adapters (lora.py's) and request i runs adapter
i mod N.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import (SHAPES, add_out_argument, commit, device_name, has_weights, instrument,  # noqa: E402
                    kernel_times, now, random_checkpoint, write_result)
from lora import write_adapter  # noqa: E402
from throughput import add_sampling_arguments, sampling, sampling_suffix, workload_a  # noqa: E402

from hookllm.worker.model_runner import StepOutput  # noqa: E402

# Host-side parts of LLMEngine.step, timed by wrapping these methods (owner path, method).
# "forward" contains "build_inputs"; "process outputs" contains "wait for tokens".
PARTS = {
    "schedule": ("engine_core.scheduler", "schedule"),
    "forward (build inputs + launch or replay)": ("engine_core.executor.runner", "forward"),
    "build_inputs": ("engine_core.executor.runner", "build_inputs"),
    "penalties and biases (launch)": ("engine_core.executor.runner.logits_adjuster", "apply"),
    "sample hook (launch)": ("hooks.hook", "sample"),
    "process outputs": ("output_processor", "process_outputs"),
    "wait for tokens": (StepOutput, "resolve"),
}


# GPU time by part of the model, from kernel names: paged attention and its K/V writes; the MoE
# layer (router top-k, the expert alignment's sort and scans, the two grouped GEMMs); the rest.
PART_OF_KERNEL = (("attention", ("attention", "store_kv", "_paged")), ("lora", ("_shrink_kernel", "_expand_kernel")),
                  ("moe", ("_gate_up_kernel", "_down_kernel", "topk", "sort", "scan", "scatter", "searchsorted")))


def kernel_part(name: str) -> str:
    lowered = name.lower()
    return next((part for part, keys in PART_OF_KERNEL if any(k.lower() in lowered for k in keys)), "rest")


def timed_steps(engine, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sync", action="store_true", help="async_scheduling=False")
    parser.add_argument("--lora-adapters", type=int, default=0, help="serve this many random LoRA adapters")
    parser.add_argument("--lora-rank", type=int, default=16)
    add_sampling_arguments(parser)
    add_out_argument(parser)
    args = parser.parse_args()

    from hookllm import LLM, SamplingParams
    from hookllm.lora.request import LoRARequest

    path = random_checkpoint(args.shape, Path(args.root))
    dummy = {} if has_weights(path) else dict(load_format="dummy")  # a config-only (MoE) shape
    lora = (dict(enable_lora=True, max_loras=args.lora_adapters, max_lora_rank=args.lora_rank)
            if args.lora_adapters else {})
    config = json.loads((path / "config.json").read_text())
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(write_adapter(
        Path(args.root) / f"lora-{args.shape}-r{args.lora_rank}-{i}", path, config, args.lora_rank, i)))
        for i in range(args.lora_adapters)]
    llm = LLM(str(path), max_model_len=2048 + 64, max_num_seqs=256, max_num_batched_tokens=8192,
              async_scheduling=not args.sync, **dummy, **lora)
    engine = llm.engine
    prompts, _ = workload_a(args.num_requests)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(**sampling(args), ignore_eos=True, max_tokens=1000, output_kind="final_only"),
                           adapters[i % len(adapters)] if adapters else None)
    while engine.engine_core.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.engine_core.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()  # warm the decode path
    # Host parts without the profiler (CUPTI slows graph launches), then GPU time under it.
    plain_ms = 1e3 * timed_steps(engine, args.steps)
    totals: dict[str, float] = defaultdict(float)
    instrument(engine, PARTS, totals)
    wall_ms = 1e3 * timed_steps(engine, args.steps)
    host_ms = {f"host_ms_{k}": 1e3 * v / args.steps for k, v in totals.items()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(engine, args.steps)
    kernels = kernel_times(prof)
    gpu_total = sum(seconds for _, seconds in kernels)
    batch = len(engine.engine_core.scheduler.running)
    rows = {"wall_ms_per_step": plain_ms, "wall_ms_per_step_timed_parts": wall_ms,
            "gpu_busy_ms_per_step": 1e3 * gpu_total / args.steps, "batch": batch,
            **host_ms}
    split: dict[str, float] = defaultdict(float)
    for name, seconds in kernels:
        split[kernel_part(name)] += 1e3 * seconds / args.steps
    rows.update({f"gpu_ms_per_step_{part}": ms for part, ms in sorted(split.items())})
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": args.shape, "per_step": rows,
               "top_kernels_us_per_step": {name[:80]: 1e6 * seconds / args.steps for name, seconds in kernels[:12]}}
    mode = ("sync" if args.sync else "async") + sampling_suffix(args) + (
        f"-lora{args.lora_adapters}r{args.lora_rank}" if args.lora_adapters else "")
    write_result(f"profile-{args.shape}-{mode}", payload, args.out)
    print(f"\n{args.shape}, {batch} running requests, {args.steps} decode steps, {mode} ({payload['commit']})")
    for key, value in rows.items():
        print(f"  {key:<52}{value:>10.2f}")
    print("  top kernels (us per step):")
    for name, us in payload["top_kernels_us_per_step"].items():
        print(f"    {us:>9.1f}  {name}")


if __name__ == "__main__":
    main()
