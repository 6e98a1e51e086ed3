"""Prefix caching, multi-turn chat and beam search on one GPU: caching on against off.

1. Shared prefix: --num-requests prompts sharing a --prefix-len system prompt, each with a
   unique 8-32 token suffix, --output-len tokens each (ignore_eos). Total tok/s (prompt +
   output) with caching off, then on (goal: >= 5x).
2. Multi-turn chat replay: --conversations conversations of --turns turns; each turn's prompt
   is the previous turn's prompt + its output + 64-160 new user tokens. Time per engine.
3. Workload A (benchmarks/throughput.py), caching off then on (goal: on <= 2% slower).
4. Beam search, width 4, on a few prompts: hookllm's LLM.beam_search against transformers
   generate(num_beams=4, early_stopping=True) on the same weights (time, and how many returned
   beams have the same tokens; bf16 ties can legitimately differ).

One engine serves every run; between runs its prefix cache is reset, so each run starts cold.

    python benchmarks/prefix_cache.py --shape llama-3.2-1b
    python benchmarks/prefix_cache.py --tiny --device cpu --num-requests 8 --prefix-len 64 \\
        --output-len 4 --conversations 2 --turns 2 --workload-a-requests 4 --beam-prompts 1 --beam-tokens 4
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (SHAPES, add_out_argument, commit, device_name, now, random_checkpoint, synchronize,  # noqa: E402
                    write_result)
from throughput import workload_a  # noqa: E402


def timed_generate(llm, prompts: list[list[int]], max_tokens: list[int], caching: bool) -> tuple[float, list]:
    """Seconds for one cold generate call with prefix caching on or off, and its outputs."""
    from hookllm import SamplingParams

    manager = llm.engine.engine_core.scheduler.block_manager
    manager.reset_prefix_cache()
    manager.enable_prefix_caching = caching
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in max_tokens]
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    synchronize()
    return time.perf_counter() - start, outputs


def on_off(name: str, llm, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    tokens = sum(len(p) for p in prompts) + sum(max_tokens)
    row = {}
    for caching in (False, True):
        stats = llm.engine.get_stats()
        seconds, _ = timed_generate(llm, prompts, max_tokens, caching)
        after = llm.engine.get_stats()
        queries = after.prefix_cache_queries - stats.prefix_cache_queries
        hits = after.prefix_cache_hits - stats.prefix_cache_hits
        key = "on" if caching else "off"
        row[key] = {"wall_s": seconds, "total_tok_s": tokens / seconds, "output_tok_s": sum(max_tokens) / seconds,
                    "hit_rate": hits / queries if queries else 0.0}
        print(f"{name} caching {key}: {tokens / seconds:.0f} total tok/s, {seconds:.2f}s, "
              f"hit rate {row[key]['hit_rate']:.2f}", flush=True)
    row["speedup"] = row["off"]["wall_s"] / row["on"]["wall_s"]
    return row


def shared_prefix(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    system = [rng.randrange(vocab) for _ in range(args.prefix_len)]
    prompts = [system + [rng.randrange(vocab) for _ in range(rng.randint(8, 32))] for _ in range(args.num_requests)]
    return prompts, [args.output_len] * args.num_requests


def multi_turn(llm, args, vocab: int, caching: bool) -> dict:
    """Replay conversations turn by turn (all conversations' turn t in one generate call)."""
    rng = random.Random(2)
    history = [[rng.randrange(vocab) for _ in range(256)] for _ in range(args.conversations)]
    manager = llm.engine.engine_core.scheduler.block_manager
    manager.reset_prefix_cache()
    seconds, tokens = 0.0, 0
    for _ in range(args.turns):
        prompts = [h + [rng.randrange(vocab) for _ in range(rng.randint(64, 160))] for h in history]
        elapsed, outputs = timed_generate_keep(llm, prompts, args.output_len, caching)
        seconds += elapsed
        tokens += sum(len(p) for p in prompts) + args.output_len * len(prompts)
        history = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs)]
    print(f"multi-turn caching {'on' if caching else 'off'}: {tokens / seconds:.0f} total tok/s, {seconds:.2f}s",
          flush=True)
    return {"wall_s": seconds, "total_tok_s": tokens / seconds}


def timed_generate_keep(llm, prompts, output_len: int, caching: bool) -> tuple[float, list]:
    """Like timed_generate, but keeps the cache warm across a conversation's turns."""
    from hookllm import SamplingParams

    llm.engine.engine_core.scheduler.block_manager.enable_prefix_caching = caching
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len))
    synchronize()
    return time.perf_counter() - start, outputs


def beam_search_vs_transformers(llm, path: Path, args, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    from hookllm import BeamSearchParams

    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.beam_prompts)]
    params = BeamSearchParams(beam_width=4, max_tokens=args.beam_tokens, ignore_eos=True)
    llm.engine.engine_core.scheduler.block_manager.enable_prefix_caching = True
    llm.beam_search({"prompt_token_ids": prompts[0]}, params)  # warm-up
    synchronize()
    start = time.perf_counter()
    ours = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    synchronize()
    ours_s = time.perf_counter() - start
    device = llm.engine.engine_core.executor.device
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=llm.engine.engine_core.executor.dtype).to(device).eval()
    theirs, theirs_s, same = [], 0.0, 0
    for prompt, output in zip(prompts, ours):
        ids = torch.tensor([prompt], device=device)
        synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=4,
                                 do_sample=False, early_stopping=True, max_new_tokens=args.beam_tokens,
                                 min_new_tokens=args.beam_tokens, eos_token_id=None, pad_token_id=0)
        synchronize()
        theirs_s += time.perf_counter() - start
        expected = [seq[len(prompt):].tolist() for seq in out]
        same += sum(s.tokens[len(prompt):] == e for s, e in zip(output.sequences, expected))
    del model
    total = 4 * len(prompts)
    print(f"beam search: hookllm {ours_s:.2f}s, transformers {theirs_s:.2f}s, {same}/{total} beams identical",
          flush=True)
    return {"hookllm_s": ours_s, "transformers_s": theirs_s, "identical_beams": same, "beams": total,
            "prompts": len(prompts), "max_tokens": args.beam_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of --shape (smoke test)")
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workload-a-requests", type=int, default=256)
    parser.add_argument("--beam-prompts", type=int, default=4)
    parser.add_argument("--beam-tokens", type=int, default=32)
    add_out_argument(parser)
    args = parser.parse_args()

    from hookllm import LLM, testing

    if args.tiny:
        path = Path(tempfile.mkdtemp()) / "tiny"
        testing.build_tiny_checkpoint(testing.tiny_llama_config(max_position_embeddings=4096), path)
        shape = "tiny"
    else:
        path, shape = random_checkpoint(args.shape, Path(args.root)), args.shape
    llm = LLM(str(path), device=args.device, max_model_len=4096)
    vocab = llm.engine.model_config.hf_config.vocab_size
    llm.generate({"prompt_token_ids": list(range(1, 40))}, testing.greedy(8))  # warm-up (kernel compilation)

    results = {"shape": shape, "device": device_name(), "commit": commit(), "date": now(), "args": vars(args)}
    results["shared_prefix"] = on_off("shared prefix", llm, *shared_prefix(args, vocab))
    off, on = multi_turn(llm, args, vocab, False), multi_turn(llm, args, vocab, True)
    results["multi_turn"] = {"off": off, "on": on, "speedup": off["wall_s"] / on["wall_s"]}
    prompts, max_tokens = workload_a(args.workload_a_requests)
    results["workload_a"] = on_off("workload A", llm, [[t % vocab for t in p] for p in prompts], max_tokens)
    results["beam_search"] = beam_search_vs_transformers(llm, path, args, vocab)
    print(f"result: {write_result('prefix_cache', results, args.out)}")

    print(f"\n{'workload':<16}{'off tok/s':>12}{'on tok/s':>12}{'on/off':>9}  goal")
    for name, goal in (("shared_prefix", ">= 5x"), ("multi_turn", "faster"), ("workload_a", ">= 0.98x")):
        row = results[name]
        print(f"{name:<16}{row['off']['total_tok_s']:>12.0f}{row['on']['total_tok_s']:>12.0f}{row['speedup']:>9.2f}  {goal}")
    beam = results["beam_search"]
    print(f"{'beam search w4':<16}{'hookllm':>12}{beam['hookllm_s']:>11.2f}s  transformers {beam['transformers_s']:.2f}s, "
          f"{beam['identical_beams']}/{beam['beams']} beams identical")


if __name__ == "__main__":
    main()
