"""Tensor parallelism: workload A at TP=1 and TP=2, a 70B shape at TP=2, and where a decode step goes.

Weights are random (``load_format="dummy"``: each rank initialises its own shard, nothing is
written to disk), so any shape runs. For each engine: output tok/s on workload A (see
throughput.py) and, for the 70B shape, the share of the physical limit: every decode step
reads the weights and the live KV once, spread over the ranks' HBM.

The decode-step split: a TP=2 engine's decode step time (CUDA graphs and eager), and the time
of the step's collectives alone (two all-reduces of [batch, hidden] per layer plus the
embedding's, and the logits all-gather), measured by replaying them on the same ranks, and the
all-reduce's latency by message size (8 KiB to 4 MiB) in a CUDA graph: NCCL's, and with
``--custom-all-reduce`` the one-shot kernel's (the engines then use it too).

    python benchmarks/tensor_parallel.py --shapes llama-3.1-8b --tp 1,2 --big llama-3.1-70b
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (SHAPES, add_out_argument, commit, device_name, linear_params_per_layer, now,  # noqa: E402
                    write_result)
from throughput import physical_limit, workload_a  # noqa: E402

SHAPES_70B = {
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256,
                          tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=500000.0),
}
ALL_SHAPES = {**SHAPES, **SHAPES_70B}


def config_only_checkpoint(shape: str, root: Path) -> Path:
    """A folder holding only config.json: enough for ``load_format="dummy"``."""
    from transformers import AutoConfig

    path = root / f"{shape}-config"
    if not (path / "config.json").exists():
        fields = dict(ALL_SHAPES[shape])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.architectures = ["LlamaForCausalLM"]
        config.torch_dtype = "bfloat16"
        config.save_pretrained(path)
    return path


def weight_bytes(shape: str) -> int:
    s = ALL_SHAPES[shape]
    h = s["hidden_size"]
    per_layer = linear_params_per_layer(s) + 2 * h  # + the two RMSNorm weights
    embeddings = s["vocab_size"] * h * (1 if s["tie_word_embeddings"] else 2)
    return 2 * (s["num_hidden_layers"] * per_layer + embeddings + h)


def run_engine(shape: str, tp: int, enforce_eager: bool, prompts, max_tokens, args) -> dict:
    from hookllm import LLM, SamplingParams
    from hookllm.distributed import cleanup_dist_env_and_memory

    path = config_only_checkpoint(shape, Path(args.root))
    start = time.perf_counter()
    llm = LLM(str(path), load_format="dummy", tensor_parallel_size=tp, max_model_len=2048 + 64,
              enforce_eager=enforce_eager, custom_all_reduce=args.custom_all_reduce)
    startup_s = time.perf_counter() - start
    try:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8), use_tqdm=False)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        step_ms = decode_step_ms(llm, args.step_batch)
        kv_tokens = llm.engine.engine_core.scheduler.block_manager.num_blocks * llm.engine.config.block_size
    finally:
        llm.engine.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    out = sum(max_tokens)
    row = {"shape": shape, "tp": tp, "cuda_graphs": not enforce_eager, "output_tok_s": out / seconds,
           "wall_s": seconds, "startup_s": startup_s, "decode_step_ms": step_ms, "kv_cache_tokens": kv_tokens}
    print(json.dumps(row), flush=True)
    return row


def decode_step_ms(llm, batch: int, steps: int = 50) -> float:
    """Mean wall time of a decode step with ``batch`` requests at about 1,000 tokens of context."""
    from hookllm import SamplingParams

    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"step{i}", {"prompt_token_ids": [(7 * i + j) % 10000 for j in range(1000)]},
                           SamplingParams(max_tokens=steps + 200, ignore_eos=True, temperature=0.6))
    while engine.engine_core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    engine.abort_request([f"step{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * elapsed


# Message sizes of the all-reduce latency table: a decode step's [batch, hidden] bf16 spans these.
LATENCY_SIZES = [2**k for k in range(13, 23)]  # 8 KiB .. 4 MiB


def _latency_us(reduce, x: torch.Tensor, calls: int = 50) -> float:
    """Microseconds per call of ``reduce(x)``, from a CUDA graph of ``calls`` calls (as a step replays them)."""
    for _ in range(3):
        reduce(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / (10 * calls)


def _collectives_rank(rank: int, shape: str, batch: int, port: int, custom: bool, result_path: str) -> None:
    import torch.distributed as dist

    from hookllm.distributed import (cleanup_dist_env_and_memory, init_custom_all_reduce, init_tensor_parallel,
                                     tensor_model_parallel_all_reduce, tensor_model_parallel_gather)

    torch.cuda.set_device(rank)
    init_tensor_parallel(rank, 2, "nccl", f"tcp://127.0.0.1:{port}", torch.device("cuda", rank))
    custom = custom and init_custom_all_reduce(torch.device("cuda", rank))
    s = ALL_SHAPES[shape]
    hidden = torch.randn(batch, s["hidden_size"], dtype=torch.bfloat16, device="cuda")
    logits = torch.randn(batch, -(-s["vocab_size"] // 2), dtype=torch.bfloat16, device="cuda")
    count = 2 * s["num_hidden_layers"] + 1
    latency = {}
    for size in LATENCY_SIZES:
        x = torch.randn(size // 2, dtype=torch.bfloat16, device="cuda")
        latency[size] = {"nccl_us": _latency_us(dist.all_reduce, x)}
        if custom:
            latency[size]["custom_us"] = _latency_us(tensor_model_parallel_all_reduce, x)

    def step() -> None:
        for _ in range(count):
            tensor_model_parallel_all_reduce(hidden)
        tensor_model_parallel_gather(logits, -1)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    if rank == 0:
        Path(result_path).write_text(json.dumps({"collectives_ms": 1e3 * (time.perf_counter() - start) / 20,
                                                 "all_reduce_latency": latency}))
    cleanup_dist_env_and_memory()


def collectives(shape: str, batch: int, custom: bool) -> dict:
    """A decode step's collectives (ms, ``collectives_ms``) and the all-reduce's latency by message
    size (NCCL's, and the one-shot kernel's with ``custom``), on two ranks."""
    import tempfile

    import torch.multiprocessing as mp

    from hookllm.worker.multiproc_executor import _free_port

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "collectives.json"
        mp.start_processes(_collectives_rank, args=(shape, batch, _free_port(), custom, str(result)), nprocs=2,
                           start_method="spawn")
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-3.1-8b", help="comma-separated shapes run at each --tp")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--big", default="llama-3.1-70b", help="a shape run at TP=2 only ('' to skip)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--step-batch", type=int, default=64, help="batch of the decode-step timing")
    parser.add_argument("--eager-too", action="store_true", help="also run TP=2 with enforce_eager")
    parser.add_argument("--eager", action="store_true", help="every engine with enforce_eager (no CUDA graphs)")
    parser.add_argument("--custom-all-reduce", action="store_true",
                        help="the engine option: small all-reduces through the one-shot kernel instead of NCCL")
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    add_out_argument(parser)
    args = parser.parse_args()

    prompts, max_tokens = workload_a(args.num_requests)
    rows: list[dict] = []
    payload = {"device": device_name(), "num_gpus": torch.cuda.device_count(), "date": now(), "commit": commit(),
               "workload": f"A: {args.num_requests} requests, input/output uniform [100, 1024], ignore_eos",
               "load_format": "dummy", "rows": rows}

    def save() -> None:
        write_result("tensor-parallel", payload, args.out)

    runs = [(shape, int(tp), args.eager) for shape in args.shapes.split(",") if shape for tp in args.tp.split(",")]
    if args.eager_too and not args.eager:
        runs += [(shape, 2, True) for shape in args.shapes.split(",") if shape]
    if args.big:
        runs.append((args.big, 2, args.eager))
    for shape, tp, eager in runs:
        try:
            row = run_engine(shape, tp, eager, prompts, max_tokens, args)
        except Exception as exc:  # one failed engine must not hide the others' numbers
            row = {"shape": shape, "tp": tp, "cuda_graphs": not eager, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(json.dumps(row), flush=True)
        if "error" not in row and tp > 1:
            row.update(collectives(shape, args.step_batch, args.custom_all_reduce))
        limit = physical_limit_tp(shape, prompts, max_tokens, tp)
        row["physical_limit_output_tok_s"] = limit
        if "output_tok_s" in row:
            row["share_of_limit"] = row["output_tok_s"] / limit
        rows.append(row)
        gc.collect()
        torch.cuda.empty_cache()
        save()

    print(f"\n{payload['device']} x{payload['num_gpus']} ({payload['commit']}), workload A, dummy weights")
    print(f"{'shape':<16}{'tp':>4}{'graphs':>8}{'out tok/s':>12}{'limit':>10}{'share':>8}{'step ms':>9}"
          f"{'comm ms':>9}{'start s':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']:<16}{row['tp']:>4}  error: {row['error'][:90]}")
            continue
        print(f"{row['shape']:<16}{row['tp']:>4}{str(row['cuda_graphs']):>8}{row['output_tok_s']:>12.0f}"
              f"{row['physical_limit_output_tok_s']:>10.0f}{row['share_of_limit']:>8.1%}{row['decode_step_ms']:>9.2f}"
              f"{row.get('collectives_ms', 0.0):>9.2f}{row['startup_s']:>9.1f}")
    by_key = {(r["shape"], r["tp"], r["cuda_graphs"]): r for r in rows if "error" not in r}
    for shape in args.shapes.split(","):
        one, two = by_key.get((shape, 1, not args.eager)), by_key.get((shape, 2, not args.eager))
        if one and two:
            print(f"{shape}: TP=2 / TP=1 = {two['output_tok_s'] / one['output_tok_s']:.2f}x")
    latency = next((r["all_reduce_latency"] for r in rows if "all_reduce_latency" in r), None)
    if latency:
        print("all-reduce latency in a CUDA graph, us per call: " + ", ".join(
            f"{int(size) // 1024} KiB NCCL {t['nccl_us']:.1f}" + (f" one-shot {t['custom_us']:.1f}" if "custom_us" in t else "")
            for size, t in latency.items()))


def physical_limit_tp(shape: str, prompts, max_tokens, tp: int) -> float:
    """Weights and live KV read once per decode step, over ``tp`` GPUs' bandwidth together."""
    return tp * physical_limit(ALL_SHAPES[shape], prompts, max_tokens, weight_bytes(shape))["output_tok_s"]


if __name__ == "__main__":
    main()
