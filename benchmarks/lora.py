"""Multi-LoRA serving: workload A with random rank-R adapters on every projection, against the
base model on the same weights, and an adapter's swap-in time.

Runs, in one process on one GPU:

1. the base model alone (an engine without ``enable_lora``): two timed calls of workload A;
2. an engine with ``enable_lora`` (``max_loras`` = the adapter count): the base model's rows
   (no request names an adapter), one adapter for every request, and ``--num-adapters``
   adapters spread over the requests (request i runs adapter i mod N), each timed twice after
   an untimed call that loads the adapters into their slots;
3. the swap-in of one adapter into a slot, from its folder (read, checked, the scaling folded in)
   and from host memory (the copies into every projection's slot), as the worker does it.

Each mode's rate is the best of its ``--calls`` calls (2), each after the prefix cache is emptied
(every call computes its prompts, as workload A's first call does); the ratios are against the
base model alone.
The adapters are PEFT folders written here (``adapter_config.json``, ``adapter_model.safetensors``),
A and B drawn from N(0, 0.02), targeting q, k, v, o, gate, up and down of every layer.

    python benchmarks/lora.py --shape llama-3.2-1b [--rank 16] [--num-adapters 8]

Writes JSON to benchmarks/results/lora-<shape>-r<rank>.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from common import add_out_argument, commit, device_name, now, synchronize, write_result  # noqa: E402
from throughput import (add_engine_arguments, checkpoint, engine_kwargs, random_workload,  # noqa: E402
                        resolve_engine_arguments, timed_call)

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted projection of one layer."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapter(folder: Path, base: Path, config: dict, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of ``base`` at ``folder`` (written once)."""
    if (folder / "adapter_model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                in_size, out_size = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                for kind, shape in (("A", (rank, in_size)), ("B", (out_size, rank))):
                    weight = torch.randn(shape, generator=generator) * 0.02
                    tensors[f"{prefix}.lora_{kind}.weight"] = weight.bfloat16()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "base_model_name_or_path": str(base),
        "target_modules": [n for names in PROJECTIONS.values() for n in names], "bias": "none"}))
    return folder


def best_rate(llm, prompts, params, lora_request, output_tokens: int, calls: int) -> float:
    """Output tok/s of the best of ``calls`` timed calls."""
    walls = []
    for _ in range(calls):
        llm.reset_prefix_cache()  # every call computes its prompts from scratch (the cache keys blocks by adapter)
        synchronize()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_request)
        synchronize()
        walls.append(time.perf_counter() - start)
    return output_tokens / min(walls)


def swap_in_seconds(worker, request) -> dict:
    """Seconds to read one adapter from its folder, and to copy it from host memory into slot 0."""
    from hookllm.lora.adapter import load_adapter

    manager = worker.lora
    start = time.perf_counter()
    adapter = load_adapter(request, manager.hf_config, manager.max_lora_rank, manager.dtype, None)
    read = time.perf_counter()
    synchronize()
    copied_from = time.perf_counter()
    for wrapper, names in manager.wrappers.items():
        wrapper.set_slot(0, [adapter.weights.get(name) for name in names])
    synchronize()
    manager.slot_of.clear()  # slot 0 now holds this adapter, not the one the map names
    manager.free_slots = list(range(manager.max_loras - 1, -1, -1))
    return {"from_disk_s": read - start + time.perf_counter() - copied_from,
            "from_host_s": time.perf_counter() - copied_from,
            "adapter_bytes": sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                                 for a, b in adapter.weights.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--calls", type=int, default=2, help="timed calls per mode (the best one counts)")
    add_out_argument(parser)
    args = parser.parse_args()
    resolve_engine_arguments(args)

    from hookllm import LLM, SamplingParams
    from hookllm.distributed import cleanup_dist_env_and_memory
    from hookllm.lora.request import LoRARequest

    path = checkpoint(args)
    config = json.loads((path / "config.json").read_text())
    vocab = config["vocab_size"]
    prompts, max_tokens = random_workload("a", args.num_requests)
    prompts = [[t % vocab for t in p] for p in prompts]  # --tiny's vocabulary is small
    params = [SamplingParams(ignore_eos=True, max_tokens=n, temperature=0.6) for n in max_tokens]
    output_tokens = sum(max_tokens)
    shape = "tiny" if args.tiny else args.shape
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(write_adapter(
        Path(args.root) / f"lora-{shape}-r{args.rank}-{i}", path, config, args.rank, i)))
        for i in range(args.num_adapters)]
    common = dict(max_model_len=2048 + 64, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, **engine_kwargs(args))

    rates: dict[str, float] = {}

    def measure(mode: str, lora_request) -> None:
        rates[mode] = best_rate(llm, prompts, params, lora_request, output_tokens, args.calls)
        print(f"{mode}: {rates[mode]:.0f} tok/s", flush=True)

    llm = LLM(str(path), **common)
    timed_call(llm, prompts, params)  # untimed: what the start-up warm-up left to compile
    measure("base model (no enable_lora)", None)
    llm.engine.shutdown()
    del llm
    cleanup_dist_env_and_memory()

    llm = LLM(str(path), enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank, **common)
    spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=spread)
    measure("enable_lora, base rows", None)
    measure("one adapter", adapters[0])
    measure(f"{len(adapters)} adapters", spread)
    extra = LoRARequest("swap-in", 1000, str(write_adapter(Path(args.root) / f"lora-{shape}-r{args.rank}-swap", path,
                                                           config, args.rank, 1000)))
    swap = llm.collective_rpc(swap_in_seconds, (extra,))[0]
    llm.engine.shutdown()

    base = rates["base model (no enable_lora)"]
    rows = [{"mode": mode, "output_tok_s": rate, "x_base": rate / base} for mode, rate in rates.items()]
    payload = {"benchmark": "lora", "shape": shape, "rank": args.rank, "num_adapters": args.num_adapters,
               "calls": args.calls, "workload": "a", "device": device_name(), "commit": commit(), "date": now(),
               "rows": rows, "swap_in": swap}
    write_result(f"lora-{shape}-r{args.rank}", payload, args.out)
    print(f"\n{'mode':<32} {'tok/s':>9} {'x base':>8}")
    for row in rows:
        print(f"{row['mode']:<32} {row['output_tok_s']:>9.0f} {row['x_base']:>8.3f}")
    print(f"swap-in of a rank-{args.rank} adapter ({swap['adapter_bytes'] / 2**20:.1f} MiB): from disk "
          f"{swap['from_disk_s'] * 1e3:.1f} ms, from host memory {swap['from_host_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
