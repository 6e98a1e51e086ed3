"""Benchmark of the Triton paged-attention kernels on one GPU (bf16, block_size 16).

Decode: batch 1/16/64/256 x context 512/2048/8192, reported as achieved HBM bandwidth (bytes
of K/V the batch needs plus Q and O, over kernel time) and as a fraction of 4.3 TB/s (the
device-to-device copy rate measured on an H200). Prefill: 1/4/16 sequences x 512..4096
tokens from an empty context, in TFLOP/s (causal: half the square counted) next to torch
SDPA (flash backend, contiguous [B, H, S, D], is_causal=True) on the same shapes.

    python benchmarks/attention.py [--tune] [--quick]

Writes JSON to $OUT/attention.json when $OUT is set, else to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
from pathlib import Path

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from hookllm.kernels import triton_attention as ta

PEAK_BYTES_PER_S = 4.3e12
MODELS = {  # name: (num_heads, num_kv_heads, head_dim)
    "Llama-3.2-1B": (32, 8, 64),
    "Llama-3.1-8B": (32, 8, 128),
}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def paged_inputs(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """Query and a paged cache exactly as large as the batch needs, blocks in shuffled order."""
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n]
        used += n
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cuda")
    query_start_loc[1:] = torch.tensor(q_lens, device="cuda").cumsum(0)
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=DTYPE),
        k_cache=torch.randn(shape, device="cuda", dtype=DTYPE),
        v_cache=torch.randn(shape, device="cuda", dtype=DTYPE),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=query_start_loc,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def bench_ms(fn) -> float:
    """Median kernel time in ms (triton's do_bench flushes L2 between runs)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_with(inputs: dict, num_splits: int, config: ta.AttentionConfig):
    args = {k: v for k, v in inputs.items() if k != "max_seq_len"}
    return lambda: ta.paged_attention_with(**args, num_splits=num_splits, config=config)


def decode_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    kv = 2 * batch * context * num_kv_heads * head_dim * 2
    qo = 2 * batch * num_heads * head_dim * 2
    return kv + qo


def causal_flops(seqs: int, tokens: int, num_heads: int, head_dim: int) -> float:
    return 4.0 * seqs * tokens * tokens * num_heads * head_dim / 2


def bench_decode(model: str, batch: int, context: int) -> dict:
    h, kvh, d = MODELS[model]
    inputs = paged_inputs([1] * batch, [context] * batch, h, kvh, d)
    ms = bench_ms(lambda: ta.paged_attention(**inputs))
    gbps = decode_bytes(batch, context, h, kvh, d) / (ms * 1e-3) / 1e9
    splits = ta.num_kv_splits(batch, kvh, 1, context, ta.num_sms(inputs["query"].device))
    del inputs
    return dict(model=model, batch=batch, context=context, ms=ms, gb_per_s=gbps,
                frac_of_peak=gbps * 1e9 / PEAK_BYTES_PER_S, num_splits=splits)


def sdpa_ms(seqs: int, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> float:
    q = torch.randn(seqs, num_heads, tokens, head_dim, device="cuda", dtype=DTYPE)
    k = torch.randn(seqs, num_kv_heads, tokens, head_dim, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True))
        except RuntimeError:  # flash backend without GQA support: expand the KV heads
            group = num_heads // num_kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def bench_prefill(model: str, seqs: int, tokens: int) -> dict:
    h, kvh, d = MODELS[model]
    inputs = paged_inputs([tokens] * seqs, [tokens] * seqs, h, kvh, d)
    ms = bench_ms(lambda: ta.paged_attention(**inputs))
    del inputs
    ref_ms = sdpa_ms(seqs, tokens, h, kvh, d)
    flops = causal_flops(seqs, tokens, h, d)
    return dict(model=model, seqs=seqs, tokens=tokens, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                sdpa_ms=ref_ms, sdpa_tflops=flops / (ref_ms * 1e-3) / 1e12, vs_sdpa=ref_ms / ms)


def tune() -> dict:
    """Time candidate launch configs and split counts on the shapes the goals are set on."""
    results: dict = {"decode_b64_ctx2048": [], "prefill_4x2048": [], "splits": []}
    decode_candidates = [(64, 4, 3), (64, 4, 2), (64, 4, 4), (32, 2, 3), (64, 2, 3), (128, 4, 3), (128, 8, 2), (32, 4, 4)]
    prefill_candidates = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2),
                          (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 4)]
    for model, (h, kvh, d) in MODELS.items():
        group = h // kvh
        inputs = paged_inputs([1] * 64, [2048] * 64, h, kvh, d)
        for bn, warps, stages in decode_candidates:
            cfg = ta.AttentionConfig(block_m=1, block_n=bn, num_warps=warps, num_stages=stages)
            ms = bench_ms(run_with(inputs, 1, cfg))
            gbps = decode_bytes(64, 2048, h, kvh, d) / (ms * 1e-3) / 1e9
            results["decode_b64_ctx2048"].append(dict(model=model, config=cfg.__dict__, ms=ms, gb_per_s=gbps))
            print(f"tune decode {model} {cfg} {ms * 1e3:.1f} us {gbps:.0f} GB/s", flush=True)
        inputs = paged_inputs([2048] * 4, [2048] * 4, h, kvh, d)
        for rows, bn, warps, stages in prefill_candidates:
            cfg = ta.AttentionConfig(block_m=rows // group, block_n=bn, num_warps=warps, num_stages=stages)
            ms = bench_ms(run_with(inputs, 1, cfg))
            tflops = causal_flops(4, 2048, h, d) / (ms * 1e-3) / 1e12
            results["prefill_4x2048"].append(dict(model=model, config=cfg.__dict__, ms=ms, tflops=tflops))
            print(f"tune prefill {model} {cfg} {ms:.3f} ms {tflops:.0f} TFLOP/s", flush=True)
        for batch in (1, 16, 64):
            inputs = paged_inputs([1] * batch, [8192] * batch, h, kvh, d)
            cfg = ta.default_config(d, group, 1)
            for splits in (1, 2, 4, 8, 16, 32, 64):
                ms = bench_ms(run_with(inputs, splits, cfg))
                results["splits"].append(dict(model=model, batch=batch, context=8192, num_splits=splits, ms=ms))
                print(f"tune splits {model} b{batch} ctx8192 splits={splits} {ms * 1e3:.1f} us", flush=True)
        del inputs
    return results


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


def tables(decode: list[dict], prefill: list[dict]) -> str:
    lines = ["| model | batch | context | splits | time (us) | GB/s | of 4.3 TB/s |", "|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['num_splits']} | {r['ms'] * 1e3:.1f} "
                     f"| {r['gb_per_s']:.0f} | {r['frac_of_peak']:.0%} |")
    lines += ["", "| model | seqs | tokens | triton (ms) | TFLOP/s | SDPA (ms) | SDPA TFLOP/s | triton/SDPA |",
              "|---|---|---|---|---|---|---|---|"]
    for r in prefill:
        lines.append(f"| {r['model']} | {r['seqs']} | {r['tokens']} | {r['ms']:.3f} | {r['tflops']:.0f} "
                     f"| {r['sdpa_ms']:.3f} | {r['sdpa_tflops']:.0f} | {r['vs_sdpa']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="also time candidate configs and split counts")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batches, contexts = ([1, 64], [2048]) if args.quick else ([1, 16, 64, 256], [512, 2048, 8192])
    seq_counts, token_counts = ([4], [2048]) if args.quick else ([1, 4, 16], [512, 1024, 2048, 4096])

    result: dict = dict(
        device=torch.cuda.get_device_name(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=commit(),
        torch=torch.__version__,
        triton=triton.__version__,
        peak_bytes_per_s=PEAK_BYTES_PER_S,
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
    )
    if args.tune:
        result["tuning"] = tune()
    decode = []
    for model in MODELS:
        for batch in batches:
            for context in contexts:
                decode.append(bench_decode(model, batch, context))
                print("decode", decode[-1], flush=True)
    prefill = []
    for model in MODELS:
        for seqs in seq_counts:
            for tokens in token_counts:
                prefill.append(bench_prefill(model, seqs, tokens))
                print("prefill", prefill[-1], flush=True)
    result.update(decode=decode, prefill=prefill)

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention.json").write_text(json.dumps(result, indent=1))
    print(f"\n{result['device']}  {result['date']}  commit {result['commit']}\n")
    print(tables(decode, prefill))


if __name__ == "__main__":
    main()
