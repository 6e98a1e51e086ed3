"""Preemption by recompute vs by swap, on a workload that overflows a deliberately small KV cache.

Workload A's requests (see throughput.py) with the cache cut to ``--num-kv-blocks`` blocks, so
running requests are preempted again and again; the same run times each ``preemption_mode``.
Recompute throws a victim's KV away and prefills it again later; swap copies its blocks to
pinned host memory and back (one batched copy per step each way).

    python benchmarks/preemption.py --shape llama-3.2-1b --num-kv-blocks 2048
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, add_out_argument, commit, device_name, now, random_checkpoint, write_result  # noqa: E402
from throughput import workload_a  # noqa: E402


def run(path: Path, mode: str, prompts, max_tokens, args) -> dict:
    from hookllm import LLM, SamplingParams, testing

    llm = LLM(str(path), max_model_len=2048 + 64, num_kv_blocks=args.num_kv_blocks, preemption_mode=mode,
              swap_space=args.swap_space, device=args.device)
    try:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8), use_tqdm=False)
        batches = testing.record_batches(llm.engine)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row = {"mode": mode, "output_tok_s": sum(max_tokens) / seconds, "wall_s": seconds,
           "scheduled_tokens": sum(b.total_num_tokens for b in batches),
           "preemptions": sum(len(b.preempted_request_ids) for b in batches),
           "blocks_swapped_out": sum(len(b.swap_out) for b in batches)}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint folder instead of --shape")
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--swap-space", type=float, default=8.0, help="GiB of pinned host memory")
    add_out_argument(parser)
    args = parser.parse_args()

    path = args.model or random_checkpoint(args.shape, Path(args.root))
    prompts, max_tokens = workload_a(args.num_requests)
    rows = [run(path, mode, prompts, max_tokens, args) for mode in ("recompute", "swap")]
    payload = {"device": device_name(), "date": now(), "commit": commit(), "model": str(args.model or args.shape),
               "num_kv_blocks": args.num_kv_blocks, "swap_space_gib": args.swap_space, "rows": rows}
    write_result(f"preemption-{args.model.name if args.model else args.shape}", payload, args.out)
    print(f"\n{payload['device']} ({payload['commit']}), workload A in {args.num_kv_blocks} KV blocks")
    print(f"{'mode':<11}{'out tok/s':>11}{'wall s':>9}{'computed tokens':>17}{'preemptions':>13}{'blocks out':>12}")
    for row in rows:
        print(f"{row['mode']:<11}{row['output_tok_s']:>11.0f}{row['wall_s']:>9.2f}{row['scheduled_tokens']:>17}"
              f"{row['preemptions']:>13}{row['blocks_swapped_out']:>12}")


if __name__ == "__main__":
    main()
