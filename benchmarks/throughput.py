"""Offline throughput (workload A) and latency (workload B) on one GPU, hookllm against its peers.

Workload A (nano-vllm's): random.seed(0); 256 prompts of randint(100, 1024) token ids drawn
from randint(0, 10000); then 256 max_tokens = randint(100, 1024); ignore_eos. Output tok/s =
sum(max_tokens) / wall time, after one warm-up. Peers on the same saved weights, in the same
process: transformers continuous batching and transformers static-batch ``generate``.

Workload B: requests arrive by a Poisson process at --rate req/s; time to first token and time
per output token, p50 and p99.

    python benchmarks/throughput.py --shape llama-3.2-1b [--skip-static] [--peer-requests 64]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (HBM_BYTES_PER_S, SHAPES, commit, device_name, now, print_engine_table,  # noqa: E402
                    add_out_argument, random_checkpoint, write_result)


def workload_a(num_requests: int = 256) -> tuple[list[list[int]], list[int]]:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_requests)]
    max_tokens = [random.randint(100, 1024) for _ in range(num_requests)]
    return prompts, max_tokens


def physical_limit(shape: str, prompts: list[list[int]], max_tokens: list[int], weight_bytes: int) -> dict:
    """Output tok/s if every decode step only read the weights once plus the live KV, at HBM speed.

    All requests decode together from step 0 (prefill is free); step t reads the weights and
    the K/V of every request still running at its current length.
    """
    s = SHAPES[shape]
    kv_bytes_per_token = s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * 2
    steps = max(max_tokens)
    total = 0.0
    inputs = np.asarray([len(p) for p in prompts])
    outs = np.asarray(max_tokens)
    for t in range(steps):
        live = outs > t
        total += weight_bytes + float((inputs[live] + t).sum()) * kv_bytes_per_token
    seconds = total / HBM_BYTES_PER_S
    return {"output_tok_s": sum(max_tokens) / seconds, "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token, "decode_steps": steps, "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "bytes_read": total}


def summarize(name: str, seconds: float, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    out_tokens, in_tokens = sum(max_tokens), sum(len(p) for p in prompts)
    row = {"output_tok_s": out_tokens / seconds, "total_tok_s": (out_tokens + in_tokens) / seconds,
           "requests_s": len(prompts) / seconds, "wall_s": seconds, "num_requests": len(prompts)}
    print(f"{name}: {row['output_tok_s']:.0f} output tok/s, {seconds:.1f}s", flush=True)
    return row


def run_hookllm(path: Path, prompts, max_tokens, enforce_eager: bool, args) -> tuple[dict, object]:
    from hookllm import LLM, SamplingParams

    llm = LLM(str(path), max_model_len=2048 + 64, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=enforce_eager)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8))  # warm-up
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    torch.cuda.synchronize()
    row = summarize("hookllm" + (" eager" if enforce_eager else ""), time.perf_counter() - start, prompts, max_tokens)
    row["kv_cache_tokens"] = llm.engine.block_manager.num_blocks * llm.engine.config.block_size
    return row, llm


def run_latency(llm, prompts, max_tokens, rate: float, num_requests: int) -> dict:
    """Workload B: Poisson arrivals in-process; TTFT and TPOT percentiles."""
    from hookllm import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    pending = list(range(num_requests))
    sent, first, done = {}, {}, {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now_s = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now_s:
            i = pending.pop(0)
            engine.add_request(f"lat{i}", {"prompt_token_ids": prompts[i]},
                               SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens[i]))
            sent[f"lat{i}"] = time.perf_counter()
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[pending[0]] - now_s))
            continue
        for out in engine.step():
            t = time.perf_counter()
            first.setdefault(out.request_id, t)
            if out.finished:
                done[out.request_id] = (t, len(out.outputs[0].token_ids))
    ttft = np.asarray([first[r] - sent[r] for r in sent])
    tpot = np.asarray([(done[r][0] - first[r]) / max(1, done[r][1] - 1) for r in sent])
    return {"rate_req_s": rate, "num_requests": num_requests,
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
            "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)), "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99))}


def load_transformers(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, device_map="cuda",
                                                attn_implementation="sdpa").eval()


def timed_peer(name: str, run, prompts, max_tokens) -> dict:
    """Warm ``run(prompts, max_tokens)`` up on two short requests, then time it on the workload."""
    run(prompts[:2], [8, 8])
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(prompts, max_tokens)
    torch.cuda.synchronize()
    return summarize(name, time.perf_counter() - start, prompts, max_tokens)


def run_transformers_cb(path: Path, prompts, max_tokens) -> dict:
    from transformers import GenerationConfig

    model = load_transformers(path)
    config = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=True, temperature=0.6, eos_token_id=None,
                              pad_token_id=0)

    def run(batch_prompts, batch_max):
        with model.continuous_batching_context_manager(generation_config=config) as manager:
            for i, (p, n) in enumerate(zip(batch_prompts, batch_max)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
            received = 0
            while received < len(batch_prompts):
                if manager.get_result(timeout=1) is not None:
                    received += 1

    return timed_peer("transformers_cb", run, prompts, max_tokens)


def run_transformers_static(path: Path, prompts, max_tokens, batch_size: int) -> dict:
    model = load_transformers(path)

    def run(batch_prompts, batch_max):
        for b in range(0, len(batch_prompts), batch_size):
            chunk, chunk_max = batch_prompts[b:b + batch_size], batch_max[b:b + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            # The batch runs to its longest request; only the tokens each asked for are counted.
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max(chunk_max),
                           min_new_tokens=max(chunk_max), do_sample=True, temperature=0.6, eos_token_id=None,
                           pad_token_id=0)

    return timed_peer("transformers_static", run, prompts, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--peer-requests", type=int, default=None,
                        help="run the transformers peers on only the first N requests (device time)")
    parser.add_argument("--skip-cb", action="store_true")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--eager-too", action="store_true", help="also time hookllm with enforce_eager")
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--latency-rate", type=float, default=0.0, help="workload B arrival rate (0: skip)")
    parser.add_argument("--latency-requests", type=int, default=128)
    add_out_argument(parser)
    args = parser.parse_args()

    path = random_checkpoint(args.shape, Path(args.root))
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    prompts, max_tokens = workload_a(args.num_requests)
    limit = physical_limit(args.shape, prompts, max_tokens, weight_bytes)
    n_peer = args.peer_requests or args.num_requests
    results: dict[str, dict] = {}
    payload = {"device": device_name(), "date": now(), "commit": commit(),
               "workload": f"A: {args.num_requests} requests, input/output uniform [100, 1024], ignore_eos"
                           + (f"; peers on the first {n_peer}" if n_peer != args.num_requests else ""),
               "model": args.shape, "results": results,
               "physical_limit_output_tok_s": limit["output_tok_s"], "physical_limit_inputs": limit}

    def save() -> None:  # after every engine, so a run cut short keeps what it measured
        write_result(f"throughput-{args.shape}", payload, args.out)

    results["hookllm"], llm = run_hookllm(path, prompts, max_tokens, False, args)
    save()
    if args.latency_rate:
        results["hookllm"]["latency"] = run_latency(llm, prompts, max_tokens, args.latency_rate, args.latency_requests)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if args.eager_too:
        results["hookllm_eager"], llm = run_hookllm(path, prompts, max_tokens, True, args)
        save()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    peers = [("transformers_cb", args.skip_cb, lambda: run_transformers_cb(path, prompts[:n_peer], max_tokens[:n_peer])),
             ("transformers_static", args.skip_static,
              lambda: run_transformers_static(path, prompts[:n_peer], max_tokens[:n_peer], args.static_batch_size))]
    for name, skip, run in peers:
        if skip:
            continue
        try:
            results[name] = run()
        except Exception as exc:  # a peer's failure is reported, never hides hookllm's numbers
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name} failed: {results[name]['error']}", flush=True)
        save()
        gc.collect()
        torch.cuda.empty_cache()
    ours = results["hookllm"]["output_tok_s"]
    print(f"\n{args.shape} on {payload['device']} ({payload['commit']}); physical limit "
          f"{limit['output_tok_s']:.0f} tok/s = sum(max_tokens) / ((steps * weight_bytes + sum KV bytes) / 4.3e12)")
    print_engine_table(results, [("out tok/s", "output_tok_s", ".0f"), ("total tok/s", "total_tok_s", ".0f"),
                                 ("req/s", "requests_s", ".2f"), ("wall s", "wall_s", ".1f")])
    print(f"hookllm reaches {ours / limit['output_tok_s']:.1%} of the physical limit; "
          f"KV cache {results['hookllm']['kv_cache_tokens']} tokens")
    if "latency" in results["hookllm"]:
        print("latency:", {k: round(v, 2) for k, v in results["hookllm"]["latency"].items()})


if __name__ == "__main__":
    main()
