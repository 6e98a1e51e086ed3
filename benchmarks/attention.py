"""Benchmark of the Triton paged-attention kernels on one GPU (bf16, block_size 16).

Decode: batch 1/16/64/256 x context 512/2048/8192, reported as achieved HBM bandwidth (bytes
of K/V the batch needs plus Q and O, over kernel time) and as a fraction of 4.3 TB/s (the
device-to-device copy rate measured on an H200). Prefill: 1/4/16 sequences x 512..4096
tokens from an empty context, in TFLOP/s (causal: half the square counted) next to torch
SDPA (flash backend, contiguous [B, H, S, D], is_causal=True) on the same shapes.

Times are GPU times from CUDA-graph replays (as the engine runs decode steps), so Python
launch overhead is left out; decode rows also give the eager time per call, which includes
it. Decode batches rotate over disjoint copies of their blocks (several times the 60 MB L2
per pass), so K/V come from HBM.

With ``--sliding-window [W]`` (W = 4096 when not given), decodes at contexts of 8192 and 32768
and prefills of 8192 and 16384 tokens run again with a window of W tokens (Mistral, Gemma 2)
next to the same shapes without it: GB/s count only the K/V in the window, TFLOP/s only the
scores inside it, and the speed-up is the time without the window over the time with it.

With ``--kv-cache-dtype fp8`` the caches hold e4m3 (scales 1.0, as an uncalibrated FP8 cache
reads) and GB/s count one byte per cached element.

With ``--mixed`` it times only steps with prefill (decodes over their cached context plus
prefill chunks from an empty one), the decodes in a launch of their own with the decode tiles
(the default) against one launch that gives every sequence the prefill tiles.

    python benchmarks/attention.py [--tune] [--quick] [--sliding-window [W]] [--kv-cache-dtype fp8] [--mixed]

Writes JSON to $OUT/attention.json when $OUT is set, else to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from hookllm.kernels import triton_attention as ta

sys.path.insert(0, str(Path(__file__).parent))
from common import HBM_BYTES_PER_S as PEAK_BYTES_PER_S, commit, device_name, now, add_out_argument, write_result  # noqa: E402

MODELS = {  # name: (num_heads, num_kv_heads, head_dim)
    "Llama-3.2-1B": (32, 8, 64),
    "Llama-3.1-8B": (32, 8, 128),
}
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
KV_DTYPES = {"auto": DTYPE, "fp8": torch.float8_e4m3fn}
kv_dtype = DTYPE  # the caches' (--kv-cache-dtype)
L2_FLUSH_BYTES = 4 * 60 * 2**20


def paged_batches(num_seqs: int, q_len: int, seq_len: int, model: str, copies: int = 1,
                  window: int | None = None) -> list[dict]:
    """``copies`` batches of one shape (``num_seqs`` sequences, ``q_len`` new tokens each) whose
    blocks are disjoint and shuffled over one cache, so that running them in turn reads HBM
    rather than L2; with ``window``, attended with that sliding window."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    per_copy = num_seqs * blocks_per_seq
    shape = (per_copy * copies, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE).to(kv_dtype)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE).to(kv_dtype)
    perm = torch.randperm(per_copy * copies, device="cuda").to(torch.int32).view(copies, num_seqs, blocks_per_seq)
    query_start_loc = torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int32)
    return [
        dict(
            query=torch.randn(num_seqs * q_len, num_heads, head_dim, device="cuda", dtype=DTYPE),
            k_cache=k_cache,
            v_cache=v_cache,
            block_tables=perm[c].contiguous(),
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=q_len,
            max_seq_len=seq_len,
            scale=head_dim**-0.5,
            **({} if window is None else dict(sliding_window=window)),
        )
        for c in range(copies)
    ]


def copies_for(nbytes: int) -> int:
    """Enough disjoint copies of a batch to stream several times the L2 (60 MB) per pass."""
    return max(1, min(256, -(-L2_FLUSH_BYTES // nbytes)))


def graph_ms(calls: list[Callable[[], object]], min_calls: int = 20, replays: int = 5) -> float:
    """GPU time of one call in ms: the calls, in turn, captured in one CUDA graph (no host
    launch overhead) and replayed; the median replay divided by the number of calls."""
    calls = calls * -(-min_calls // len(calls))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) / len(calls)


def eager_ms(call: Callable[[], object], n: int = 50) -> float:
    """Time per call of ``n`` back-to-back eager calls: host-bound when the kernels are short."""
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def attention_call(batch: dict, num_splits: int | None = None, config: ta.AttentionConfig | None = None):
    """The public kernel entry, or ``paged_attention_with`` when a split count and config are forced."""
    if config is None:
        return lambda: ta.paged_attention(**batch)
    args = {k: v for k, v in batch.items() if k != "max_seq_len"}
    return lambda: ta.paged_attention_with(**args, num_splits=num_splits, config=config)


def decode_bytes(batch: int, context: int, model: str, window: int | None = None) -> int:
    """Bytes a decode step must move: each sequence's K and V (those in the window), plus its
    query and output."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    keys = context if window is None else min(context, window)
    return 2 * batch * keys * num_kv_heads * head_dim * kv_dtype.itemsize + 2 * batch * num_heads * head_dim * 2


def causal_flops(seqs: int, tokens: int, model: str, window: int | None = None) -> float:
    """Matmul FLOPs of causal attention over fresh prompts: half the square, or with a window
    the band of width ``window`` under the diagonal."""
    num_heads, _, head_dim = MODELS[model]
    width = tokens if window is None else min(window, tokens)
    return 4.0 * seqs * (tokens * width - width * width / 2) * num_heads * head_dim


def bench_decode(model: str, batch: int, context: int, window: int | None = None) -> dict:
    nbytes = decode_bytes(batch, context, model, window)
    batches = paged_batches(batch, 1, context, model, copies_for(nbytes), window)
    ms = graph_ms([attention_call(b) for b in batches])
    eager = eager_ms(attention_call(batches[0]))
    kv_heads = MODELS[model][1]
    keys = context if window is None else min(context, window)
    splits = ta.num_kv_splits(batch, kv_heads, 1, keys, ta.num_sms(torch.device("cuda", torch.cuda.current_device())))
    return dict(model=model, batch=batch, context=context, ms=ms, eager_ms=eager, gb_per_s=nbytes / (ms * 1e-3) / 1e9,
                frac_of_peak=nbytes / (ms * 1e-3) / PEAK_BYTES_PER_S, num_splits=splits)


def sdpa_call(seqs: int, tokens: int, model: str):
    """torch SDPA, flash backend, contiguous [B, H, S, D], causal; GQA through enable_gqa when
    the backend takes it, else with the KV heads expanded."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    q = torch.randn(seqs, num_heads, tokens, head_dim, device="cuda", dtype=DTYPE)
    k = torch.randn(seqs, num_kv_heads, tokens, head_dim, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa(q, k, v, is_causal=True, enable_gqa=True)
        gqa = True
    except RuntimeError:
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        gqa = False

    def call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)

    return call


def bench_prefill(model: str, seqs: int, tokens: int) -> dict:
    ms = graph_ms([attention_call(paged_batches(seqs, tokens, tokens, model)[0])], min_calls=10)
    ref_ms = graph_ms([sdpa_call(seqs, tokens, model)], min_calls=10)
    flops = causal_flops(seqs, tokens, model)
    return dict(model=model, seqs=seqs, tokens=tokens, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                sdpa_ms=ref_ms, sdpa_tflops=flops / (ref_ms * 1e-3) / 1e12, vs_sdpa=ref_ms / ms)


# Alternatives timed by --tune next to the defaults: decode (block_n, warps, stages),
# prefill (query rows, block_n, warps, stages).
DECODE_CANDIDATES = [(128, 4, 3), (64, 4, 2), (64, 4, 3), (64, 2, 3), (128, 4, 2), (128, 8, 2), (128, 4, 4),
                     (256, 4, 2), (256, 8, 2), (256, 4, 3)]
PREFILL_CANDIDATES = [(128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3),
                      (64, 128, 4, 3), (128, 128, 8, 2)]


def bench_window(window: int, quick: bool) -> dict:
    """Long decodes and prefills with a sliding window of ``window`` tokens, each next to the
    same shape without it."""
    batches, contexts = ([1, 64], [32768]) if quick else ([1, 16, 64], [8192, 32768])
    token_counts = [8192] if quick else [8192, 16384]
    decode, prefill = [], []
    for model in MODELS:
        for batch in batches:
            for context in contexts:
                row = bench_decode(model, batch, context, window)
                full_ms = graph_ms([attention_call(b) for b in paged_batches(
                    batch, 1, context, model, copies_for(decode_bytes(batch, context, model)))])
                decode.append(dict(row, window=window, full_ms=full_ms, speedup=full_ms / row["ms"]))
                print("windowed decode", decode[-1], flush=True)
        for tokens in token_counts:
            ms = graph_ms([attention_call(paged_batches(1, tokens, tokens, model, window=window)[0])], min_calls=10)
            full_ms = graph_ms([attention_call(paged_batches(1, tokens, tokens, model)[0])], min_calls=10)
            tflops = causal_flops(1, tokens, model, window) / (ms * 1e-3) / 1e12
            prefill.append(dict(model=model, seqs=1, tokens=tokens, window=window, ms=ms, tflops=tflops,
                                full_ms=full_ms, speedup=full_ms / ms))
            print("windowed prefill", prefill[-1], flush=True)
    return dict(window=window, decode=decode, prefill=prefill)


def tune() -> dict:
    """Time candidate launch configs and split counts on the shapes the goals are set on."""
    results: dict = {"decode_b64_ctx2048": [], "prefill_4x2048": [], "splits": []}
    for model, (num_heads, num_kv_heads, head_dim) in MODELS.items():
        group = num_heads // num_kv_heads
        nbytes = decode_bytes(64, 2048, model)
        batches = paged_batches(64, 1, 2048, model, copies_for(nbytes))
        for block_n, warps, stages in DECODE_CANDIDATES:
            cfg = ta.AttentionConfig(block_m=1, block_n=block_n, num_warps=warps, num_stages=stages)
            ms = graph_ms([attention_call(b, 1, cfg) for b in batches])
            results["decode_b64_ctx2048"].append(
                dict(model=model, config=cfg.__dict__, ms=ms, gb_per_s=nbytes / (ms * 1e-3) / 1e9))
            print(f"tune decode {model} {cfg} {ms * 1e3:.1f} us {nbytes / ms / 1e6:.0f} GB/s", flush=True)
        batch = paged_batches(4, 2048, 2048, model)[0]
        for rows, block_n, warps, stages in PREFILL_CANDIDATES:
            cfg = ta.AttentionConfig(block_m=rows // group, block_n=block_n, num_warps=warps, num_stages=stages)
            ms = graph_ms([attention_call(batch, 1, cfg)], min_calls=10)
            tflops = causal_flops(4, 2048, model) / (ms * 1e-3) / 1e12
            results["prefill_4x2048"].append(dict(model=model, config=cfg.__dict__, ms=ms, tflops=tflops))
            print(f"tune prefill {model} {cfg} {ms:.3f} ms {tflops:.0f} TFLOP/s", flush=True)
        cfg = ta.default_config(head_dim, group, 1, kv_dtype == torch.float8_e4m3fn)
        for seqs, context in ((1, 8192), (16, 2048), (16, 8192), (64, 8192)):
            batches = paged_batches(seqs, 1, context, model, copies_for(decode_bytes(seqs, context, model)))
            for splits in (1, 2, 4, 8, 16, 32):
                ms = graph_ms([attention_call(b, splits, cfg) for b in batches])
                results["splits"].append(dict(model=model, batch=seqs, context=context, num_splits=splits, ms=ms))
                print(f"tune splits {model} b{seqs} ctx{context} splits={splits} {ms * 1e3:.1f} us", flush=True)
    return results


def tables(decode: list[dict], prefill: list[dict]) -> str:
    lines = ["| model | batch | context | splits | GPU time (us) | GB/s | of 4.3 TB/s | eager call (us) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['num_splits']} | {r['ms'] * 1e3:.1f} "
                     f"| {r['gb_per_s']:.0f} | {r['frac_of_peak']:.0%} | {r['eager_ms'] * 1e3:.1f} |")
    lines += ["", "| model | seqs | tokens | triton (ms) | TFLOP/s | SDPA (ms) | SDPA TFLOP/s | triton/SDPA |",
              "|---|---|---|---|---|---|---|---|"]
    for r in prefill:
        lines.append(f"| {r['model']} | {r['seqs']} | {r['tokens']} | {r['ms']:.3f} | {r['tflops']:.0f} "
                     f"| {r['sdpa_ms']:.3f} | {r['sdpa_tflops']:.0f} | {r['vs_sdpa']:.0%} |")
    return "\n".join(lines)


def window_tables(result: dict) -> str:
    lines = [f"sliding window {result['window']}", "",
             "| model | batch | context | splits | GPU time (us) | GB/s in window | without window (us) | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["decode"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['num_splits']} | {r['ms'] * 1e3:.1f} "
                     f"| {r['gb_per_s']:.0f} | {r['full_ms'] * 1e3:.1f} | {r['speedup']:.2f}x |")
    lines += ["", "| model | seqs | tokens | GPU time (ms) | TFLOP/s in window | without window (ms) | speed-up |",
              "|---|---|---|---|---|---|---|"]
    for r in result["prefill"]:
        lines.append(f"| {r['model']} | {r['seqs']} | {r['tokens']} | {r['ms']:.3f} | {r['tflops']:.0f} "
                     f"| {r['full_ms']:.3f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def mixed_batch(model: str, decodes: int, context: int, prefills: int, chunk: int) -> dict:
    """A step with prefill as the engine runs it: ``decodes`` sequences of one query token over
    ``context`` cached keys, then ``prefills`` chunks of ``chunk`` tokens from an empty context."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    q_lens = [1] * decodes + [chunk] * prefills
    seq_lens = [context + 1] * decodes + [chunk] * prefills
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    width = max(blocks)
    shape = (sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim)
    order = torch.randperm(sum(blocks), device="cuda").to(torch.int32)
    tables = torch.zeros((len(q_lens), width), dtype=torch.int32, device="cuda")
    start = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = order[start:start + n]
        start += n
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    return dict(query=torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=DTYPE),
                k_cache=torch.randn(shape, device="cuda", dtype=DTYPE).to(kv_dtype),
                v_cache=torch.randn(shape, device="cuda", dtype=DTYPE).to(kv_dtype),
                block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                query_start_loc=query_start_loc.cuda(), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                scale=head_dim**-0.5)


def bench_mixed(quick: bool) -> list[dict]:
    """Steps with prefill: the decodes in a launch of their own (``SEPARATE_DECODES``, the
    default) against one launch with the prefill tiles for every sequence."""
    shapes = [(256, 1024, 2, 512)] if quick else [(64, 1024, 2, 512), (256, 1024, 2, 512), (256, 512, 1, 2048),
                                                 (128, 4096, 4, 1024)]
    results = []
    for model in MODELS:
        for decodes, context, prefills, chunk in shapes:
            batch = mixed_batch(model, decodes, context, prefills, chunk)
            row = dict(model=model, decodes=decodes, context=context, prefills=prefills, chunk=chunk)
            for separate in (False, True):
                ta.SEPARATE_DECODES = separate
                row["separate_ms" if separate else "one_launch_ms"] = graph_ms([attention_call(batch)])
            ta.SEPARATE_DECODES = True
            row["speedup"] = row["one_launch_ms"] / row["separate_ms"]
            results.append(row)
            print("mixed", row, flush=True)
    return results


def mixed_table(rows: list[dict]) -> str:
    lines = [f"{'model':<14}{'decodes x context':>18}{'prefill chunks':>16}{'one launch ms':>15}"
             f"{'decodes apart ms':>18}{'speed-up':>10}"]
    for r in rows:
        lines.append(f"{r['model']:<14}{r['decodes']:>9} x {r['context']:<6}{r['prefills']:>8} x {r['chunk']:<5}"
                     f"{r['one_launch_ms']:>15.3f}{r['separate_ms']:>18.3f}{r['speedup']:>10.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true", help="also time candidate configs and split counts")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    parser.add_argument("--sliding-window", type=int, nargs="?", const=4096, metavar="W",
                        help="also time long decodes and prefills with a sliding window of W tokens (default 4096)")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPES), default="auto",
                        help="the caches' dtype: auto (bf16) or fp8 (e4m3)")
    parser.add_argument("--mixed", action="store_true",
                        help="only steps with prefill: decodes in a launch of their own against one launch")
    add_out_argument(parser)
    args = parser.parse_args()
    global kv_dtype
    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    torch.manual_seed(0)
    batches, contexts = ([1, 64], [2048]) if args.quick else ([1, 16, 64, 256], [512, 2048, 8192])
    seq_counts, token_counts = ([4], [2048]) if args.quick else ([1, 4, 16], [512, 1024, 2048, 4096])

    result: dict = dict(
        device=device_name(),
        date=now(),
        commit=commit(),
        torch=torch.__version__,
        triton=triton.__version__,
        peak_bytes_per_s=PEAK_BYTES_PER_S,
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
    )
    if args.mixed:
        result["mixed"] = bench_mixed(args.quick)
        write_result("attention-mixed", result, args.out)
        print(f"\n{result['device']}  {result['date']}  commit {result['commit']}\n\n" + mixed_table(result["mixed"]))
        return
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
    if args.sliding_window:
        result["sliding_window"] = bench_window(args.sliding_window, args.quick)

    write_result("attention" + ("-kvfp8" if args.kv_cache_dtype == "fp8" else ""), result, args.out)
    print(f"\n{result['device']}  {result['date']}  commit {result['commit']}\n")
    print(tables(decode, prefill))
    if args.sliding_window:
        print("\n" + window_tables(result["sliding_window"]))


if __name__ == "__main__":
    main()
