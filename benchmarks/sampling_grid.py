"""Every sampling setting against temperature alone, end to end: one engine, workload A (or
short), each setting's call between two temperature-only calls, the ratio taken against their mean.

The grid covers what clients send: top-k from 1 to the whole vocabulary, top-p from 0.1 to 1,
min-p, the three together, the generation_config defaults of Llama 3, Qwen 3 and Gemma 3
checkpoints, logprobs, and mixes (a quarter of the rows filtered, every row a different value).
Temperature 0.6 unless the setting names its own.

    python benchmarks/sampling_grid.py --shape llama-3.2-1b [--workload a|short] [--only top_k,min_p]

Writes JSON to benchmarks/results/sampling-grid-<shape>-<workload>.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import add_out_argument, commit, device_name, now, write_result  # noqa: E402
from throughput import (WORKLOADS, add_engine_arguments, checkpoint, random_workload,  # noqa: E402
                        resolve_engine_arguments, start_llm, timed_call)

VOCAB = "vocab"  # top_k: the whole vocabulary (keeps every token)
# name -> the sampling fields of every request, or a list cycled over the requests (a mix).
GRID: dict[str, dict | list[dict]] = {
    **{f"top_k {k}": {"top_k": k} for k in (1, 20, 50, 1000, VOCAB)},
    **{f"top_p {p}": {"top_p": p} for p in (0.1, 0.5, 0.9, 0.95, 0.99)},
    **{f"min_p {p}": {"min_p": p} for p in (0.05, 0.5)},
    "top_k 50 + top_p 0.9 + min_p 0.05": {"top_k": 50, "top_p": 0.9, "min_p": 0.05},
    "Llama 3 defaults (T 0.6, top_p 0.9)": {"temperature": 0.6, "top_p": 0.9},
    "Qwen 3 defaults (T 0.6, top_p 0.95, top_k 20)": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    "Gemma 3 defaults (T 1.0, top_p 0.95, top_k 64)": {"temperature": 1.0, "top_p": 0.95, "top_k": 64},
    **{f"logprobs {n}": {"logprobs": n} for n in (1, 5, 20)},
    "logprobs 5 + top_p 0.9": {"logprobs": 5, "top_p": 0.9},
    "mix: 1/4 top_k 20": [{"top_k": 20}, {}, {}, {}],
    "mix: 1/4 logprobs 5": [{"logprobs": 5}, {}, {}, {}],
    "mix: every row its own": [{"top_k": 1 + 37 * i % 500, "top_p": 0.5 + (i % 50) / 100, "min_p": (i % 7) / 100}
                               for i in range(64)],
}


def request_params(setting: dict | list[dict], max_tokens: list[int], vocab: int) -> list:
    from hookllm import SamplingParams

    mix = setting if isinstance(setting, list) else [setting]
    params = []
    for i, n in enumerate(max_tokens):
        fields = {"temperature": 0.6, **mix[i % len(mix)]}
        if fields.get("top_k") == VOCAB:
            fields["top_k"] = vocab
        params.append(SamplingParams(ignore_eos=True, max_tokens=n, **fields))
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--workload", default="a", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--only", default=None,
                        help="run the settings whose name contains one of these (comma-separated)")
    add_out_argument(parser)
    args = parser.parse_args()
    resolve_engine_arguments(args)

    path = checkpoint(args)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts, max_tokens = random_workload(args.workload, args.num_requests)
    prompts = [[t % vocab for t in p] for p in prompts]  # --tiny's vocabulary is small
    llm, startup = start_llm(path, args, 2048 + 64)
    parts = args.only.split(",") if args.only else [""]
    settings = {name: s for name, s in GRID.items() if any(part in name for part in parts)}
    plain = request_params({}, max_tokens, vocab)
    output_tokens = sum(max_tokens)
    timed_call(llm, prompts, plain)  # a first call, untimed: what the warm-up left to compile
    before = output_tokens / timed_call(llm, prompts, plain)
    rows = []
    for name, setting in settings.items():
        rate = output_tokens / timed_call(llm, prompts, request_params(setting, max_tokens, vocab))
        after = output_tokens / timed_call(llm, prompts, plain)
        reference = statistics.mean([before, after])
        rows.append({"setting": name, "output_tok_s": rate, "temperature_only_tok_s": reference,
                     "ratio": rate / reference})
        print(f"{name:<48} {rate:>9.0f} tok/s  {rate / reference:.3f}x of {reference:.0f}", flush=True)
        before = after
    payload = {"benchmark": "sampling_grid", "shape": args.shape, "workload": args.workload, "device": device_name(),
               "commit": commit(), "date": now(), "startup": startup, "rows": rows}
    shape = "tiny" if args.tiny else args.shape
    write_result(f"sampling-grid-{shape}-{args.workload}", payload, args.out)
    print(f"\n{'setting':<48} {'tok/s':>9} {'x temperature only':>19}")
    for row in rows:
        print(f"{row['setting']:<48} {row['output_tok_s']:>9.0f} {row['ratio']:>19.3f}")


if __name__ == "__main__":
    main()
