"""Offline throughput (workloads A and short) and latency (workload B, batch 1) on one GPU, hookllm against its peers.

Workload A (nano-vllm's): random.seed(0); 256 prompts of randint(100, 1024) token ids drawn
from randint(0, 10000); then 256 max_tokens = randint(100, 1024); ignore_eos. Output tok/s =
sum(max_tokens) / wall time, after one warm-up. Peers on the same saved weights, in the same
process: transformers continuous batching and transformers static-batch ``generate``.

Workload short: the same recipe with 2,048 requests and lengths randint(32, 320); hookllm only.
``--repeat N`` times N calls of the workload on one engine, after the one warm-up.

Workload B: requests arrive by a Poisson process at --rate req/s; time to first token and time
per output token, p50 and p99.

Workload latency: one request alone, a 3,000-token prompt and 256 output tokens, greedy unless
sampling options are given (ignore_eos), ``--repeat`` times (default 5); time to first token and
time per output token from the request's metrics.

Sampling: temperature 0.6, plus ``--top-p``, ``--top-k``, ``--min-p``, the penalties and ``--n``
when given (``--n k``: k completions of each prompt, every one's tokens counted; no peers then).

``--quantization fp8`` quantizes the linear layers at load (per-channel weights, per-token
activations; MoE experts weight-only) and ``--kv-cache-dtype fp8`` stores K/V in e4m3; the limits then count those bytes
and the FP8 rate, and the result file's name says so (``-fp8``, ``-kvfp8``).

    python benchmarks/throughput.py --shape llama-3.2-1b [--workload a|short|latency] [--repeat N] [--skip-static]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (BF16_FLOP_PER_S, FP8_FLOP_PER_S, HBM_BYTES_PER_S, SHAPES, add_out_argument, commit,  # noqa: E402
                    config_weight_bytes, device_name, expert_params, has_weights, head_dim,
                    linear_params_per_layer, moe_experts, now, print_engine_table, random_checkpoint, synchronize,
                    write_result)

# Throughput workloads: name -> (label, lowest length, highest length, requests); prompts and
# outputs draw their lengths from the same range.
WORKLOADS = {"a": ("A", 100, 1024, 256), "short": ("short", 32, 320, 2048)}
# Sampling filters, penalties, n and logprobs a run may add to workload A's temperature 0.6 (--top-p ...), as
# chat clients send them; the transformers peers apply those `generate` has (no presence or
# frequency penalty).
SAMPLING_OPTIONS = {"top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
                    "presence_penalty": float, "frequency_penalty": float, "n": int, "logprobs": int}
PEER_SAMPLING_OPTIONS = ("top_p", "top_k", "min_p", "repetition_penalty")
LATENCY_PROMPT_TOKENS = 3000
LATENCY_OUTPUT_TOKENS = 256


def random_workload(name: str, num_requests: int | None = None) -> tuple[list[list[int]], list[int]]:
    """random.seed(0); prompts of randint(low, high) token ids drawn from randint(0, 10000), then as
    many max_tokens = randint(low, high); ``num_requests`` defaults to the workload's own count."""
    _, low, high, default = WORKLOADS[name]
    n = num_requests or default
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(low, high))] for _ in range(n)]
    max_tokens = [random.randint(low, high) for _ in range(n)]
    return prompts, max_tokens


def workload_a(num_requests: int = 256) -> tuple[list[list[int]], list[int]]:
    return random_workload("a", num_requests)


def describe(name: str, num_requests: int) -> str:
    label, low, high, _ = WORKLOADS[name]
    return f"{label}: {num_requests} requests, input/output uniform [{low}, {high}], ignore_eos"


def latency_prompt() -> list[int]:
    random.seed(0)
    return [random.randint(0, 10000) for _ in range(LATENCY_PROMPT_TOKENS)]


def kv_bytes_per_token(config: dict, element_bytes: int = 2) -> int:
    """K and V of every layer, ``element_bytes`` each (2: bf16, 1: an fp8 KV cache)."""
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim(config) * element_bytes


def sliding_layers(config: dict) -> int:
    """How many layers attend to a sliding window of ``config["sliding_window"]`` tokens only."""
    if not config.get("sliding_window"):
        return 0
    return sum(kind == "sliding_attention" for kind in config.get("layer_types") or
               ["sliding_attention"] * config["num_hidden_layers"])


def kv_bytes_read(config: dict, prompts: list[list[int]], max_tokens: list[int], element_bytes: int = 2) -> float:
    """K/V bytes the decode steps read: a request reads its context at lengths len(p) .. len(p) + n - 1,
    a sliding layer at most its window of it."""
    per_layer_token = 2 * config["num_key_value_heads"] * head_dim(config) * element_bytes
    windowed, window = sliding_layers(config), config.get("sliding_window") or 0
    total = 0.0
    for p, n in zip(prompts, max_tokens):
        full = n * len(p) + n * (n - 1) // 2
        capped = sum(min(len(p) + j, window) for j in range(n)) if windowed else 0
        total += per_layer_token * ((config["num_hidden_layers"] - windowed) * full + windowed * capped)
    return total


def decode_batches(max_tokens: list[int], max_batch: int) -> list[int]:
    """The running batch of each decode step until every request is done, one token per running
    request per step, at most ``max_batch`` running at once: each waiting request takes the first
    place that frees up."""
    free_at = [0] * min(max_batch, len(max_tokens))  # a heap: the step each place frees up
    spans = []
    for n in max_tokens:
        start = heapq.heappop(free_at)
        spans.append((start, start + n))
        heapq.heappush(free_at, start + n)
    running = np.zeros(max(free_at) + 1, dtype=np.int64)
    for start, end in spans:
        running[start] += 1
        running[end] -= 1
    return np.cumsum(running)[:-1].tolist()


def decode_steps(max_tokens: list[int], max_batch: int) -> int:
    return len(decode_batches(max_tokens, max_batch))


def step_weight_bytes(config: dict, weight_bytes: int, batch: int, expert_element_bytes: int = 2) -> float:
    """Weight bytes a decode step of ``batch`` requests reads: all of a dense model's; of an MoE
    model's experts (``expert_element_bytes`` per weight), only those the batch's tokens are routed
    to, which under uniform routing is ``E * (1 - (1 - k/E)^batch)`` of each layer's ``E`` (random
    weights route about uniformly)."""
    moe = moe_experts(config)
    if moe is None:
        return float(weight_bytes)
    experts, top_k, _ = moe
    all_experts = expert_element_bytes * config["num_hidden_layers"] * experts * expert_params(config)
    touched = experts * (1.0 - (1.0 - top_k / experts) ** batch)
    return weight_bytes - all_experts + all_experts * touched / experts


def fp8_params_per_layer(config: dict) -> int:
    """Weights of one decoder layer that ``--quantization fp8`` multiplies in FP8 GEMMs: the
    attention projections and a dense MLP (MoE experts are e4m3 too, but run weight-only, at the
    bf16 rate; routers stay bf16)."""
    if moe_experts(config) is None:
        return linear_params_per_layer(config)
    h = config["hidden_size"]
    q, kv = config["num_attention_heads"] * head_dim(config), config["num_key_value_heads"] * head_dim(config)
    return h * (q + 2 * kv) + q * h


def fp8_weight_bytes(config: dict, weight_bytes: int) -> int:
    """The bf16 checkpoint's ``weight_bytes`` with the layers' quantized weights at 1 byte each:
    those of ``fp8_params_per_layer`` and every expert (embeddings, lm_head, routers and norms
    stay at 2)."""
    moe = moe_experts(config)
    experts = 0 if moe is None else moe[0] * expert_params(config)
    return weight_bytes - config["num_hidden_layers"] * (fp8_params_per_layer(config) + experts)


def prefill_flops(config: dict, prompts: list[list[int]]) -> float:
    """Matmul FLOPs of the prompts' forward passes: 2 x the layers' linear weights per prompt token,
    causal attention (QK^T and PV: 4 x query width per key a query sees, per layer), and one
    lm_head row per prompt (only the last position is sampled)."""
    layers, tokens = config["num_hidden_layers"], sum(len(p) for p in prompts)
    causal_pairs = sum(len(p) * (len(p) + 1) // 2 for p in prompts)
    q_width = config["num_attention_heads"] * head_dim(config)
    return (2.0 * layers * linear_params_per_layer(config) * tokens + 4.0 * layers * q_width * causal_pairs
            + 2.0 * config["vocab_size"] * config["hidden_size"] * len(prompts))


def fp8_prefill_flops(config: dict, prompts: list[list[int]]) -> float:
    """The part of ``prefill_flops`` in the layers that ``--quantization fp8`` quantizes."""
    return 2.0 * config["num_hidden_layers"] * fp8_params_per_layer(config) * sum(len(p) for p in prompts)


def physical_limit(config: dict, prompts: list[list[int]], max_tokens: list[int], weight_bytes: int,
                   max_batch: int | None = None, quantization: str | None = None, kv_cache_dtype: str = "auto") -> dict:
    """Output tok/s the GPU allows: decode only, and with the prompts' prefill added.

    Decode only: every decode step reads the weights once (of an MoE model, the experts its
    batch touches: ``step_weight_bytes``) plus the K/V of every running request at its current
    length (``kv_bytes_read``), at HBM speed; at most ``max_batch`` requests run at once (default: all),
    and prefill is free. With prefill: the prompts' FLOPs (``prefill_flops``) at the dense bf16
    rate are added, not overlapped with decoding.

    ``weight_bytes`` are the bf16 checkpoint's. With ``quantization="fp8"`` the quantized layers'
    weights (experts included) count 1 byte each (``fp8_weight_bytes``) and their FLOPs (``fp8_prefill_flops``) run
    at the dense FP8 rate; with ``kv_cache_dtype="fp8"`` K/V count 1 byte per element.
    """
    checkpoint_bytes = weight_bytes
    if quantization == "fp8":
        weight_bytes = fp8_weight_bytes(config, weight_bytes)
    kv_element = 1 if kv_cache_dtype == "fp8" else 2
    kv_per_token = kv_bytes_per_token(config, kv_element)
    batches = decode_batches(max_tokens, max_batch or len(max_tokens))
    steps = len(batches)
    expert_element = 1 if quantization == "fp8" else 2
    step_bytes = {b: step_weight_bytes(config, weight_bytes, b, expert_element) for b in set(batches)}
    weights_read = sum(step_bytes[b] for b in batches)
    total = weights_read + kv_bytes_read(config, prompts, max_tokens, kv_element)
    flops = prefill_flops(config, prompts)
    fp8_flops = fp8_prefill_flops(config, prompts) if quantization == "fp8" else 0.0
    decode_s = total / HBM_BYTES_PER_S
    prefill_s = (flops - fp8_flops) / BF16_FLOP_PER_S + fp8_flops / FP8_FLOP_PER_S
    return {"output_tok_s": sum(max_tokens) / decode_s,
            "output_tok_s_with_prefill": sum(max_tokens) / (decode_s + prefill_s),
            "weight_bytes": weight_bytes, "weight_bytes_read": weights_read, "kv_bytes_per_token": kv_per_token,
            "decode_steps": steps,
            "max_batch": max_batch, "hbm_bytes_per_s": HBM_BYTES_PER_S, "bytes_read": total,
            "prefill_flops": flops, "bf16_flop_per_s": BF16_FLOP_PER_S, "prefill_s": prefill_s,
            "quantization": quantization, "kv_cache_dtype": kv_cache_dtype, "checkpoint_weight_bytes": checkpoint_bytes,
            "fp8_prefill_flops": fp8_flops, "fp8_flop_per_s": FP8_FLOP_PER_S}


def summarize(name: str, seconds: float, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    out_tokens, in_tokens = sum(max_tokens), sum(len(p) for p in prompts)
    row = {"output_tok_s": out_tokens / seconds, "total_tok_s": (out_tokens + in_tokens) / seconds,
           "requests_s": len(prompts) / seconds, "wall_s": seconds, "num_requests": len(prompts)}
    print(f"{name}: {row['output_tok_s']:.0f} output tok/s, {seconds:.1f}s", flush=True)
    return row


def add_sampling_arguments(parser) -> None:
    """``--top-p``, ``--top-k``, ... : one option per ``SAMPLING_OPTIONS`` entry, unset by default."""
    for name, kind in SAMPLING_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"every request's {name} (default: unset; temperature is 0.6)")


def sampling(args) -> dict:
    """The workload's sampling parameters: temperature 0.6 and the options given on the command line."""
    chosen = {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name, None) is not None}
    return {"temperature": 0.6, **chosen}


def peer_sampling(args) -> dict:
    return {k: v for k, v in sampling(args).items() if k == "temperature" or k in PEER_SAMPLING_OPTIONS}


def sampling_suffix(args) -> str:
    """``-top_p0.9-top_k50`` for a run with options, so its result file does not replace the plain run's."""
    return "".join(f"-{k}{v}" for k, v in sampling(args).items() if k != "temperature")


def precision(args) -> dict:
    """``--quantization`` and ``--kv-cache-dtype`` as engine options, only those set (a plain run passes neither)."""
    chosen = {"quantization": getattr(args, "quantization", None)}
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        chosen["kv_cache_dtype"] = args.kv_cache_dtype
    return {k: v for k, v in chosen.items() if v is not None}


def precision_suffix(args) -> str:
    """``-fp8`` (quantized linear layers) and ``-kvfp8`` (fp8 KV cache), so an FP8 run's result file
    does not replace the bf16 run's."""
    chosen = precision(args)
    return ("-" + chosen["quantization"] if "quantization" in chosen else "") + (
        "-kv" + chosen["kv_cache_dtype"] if "kv_cache_dtype" in chosen else "")


def engine_kwargs(args) -> dict:
    impl = {} if args.model_impl is None else dict(model_impl=args.model_impl)
    if getattr(args, "distributed_executor_backend", None):
        impl["distributed_executor_backend"] = args.distributed_executor_backend
    if args.tiny:
        return dict(device="cpu", dtype="float32", **impl, **precision(args))
    dummy = {} if has_weights(checkpoint(args)) else dict(load_format="dummy")  # a config-only shape
    return dict(max_cuda_graph_tokens=args.max_cuda_graph_tokens, **impl, **dummy, **precision(args))


def limit_kwargs(args) -> dict:
    """``physical_limit``'s precision arguments for this run."""
    return dict(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)


def start_llm(path: Path, args, max_model_len: int, enforce_eager: bool = False) -> tuple[object, dict]:
    """The engine after one warm-up call, and the seconds it took to build and to warm up."""
    from hookllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=enforce_eager, **engine_kwargs(args))
    built = time.perf_counter()
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8), use_tqdm=False)
    synchronize()
    return llm, {"llm_init_s": built - start, "warmup_s": time.perf_counter() - built}


def timed_call(llm, prompts: list[list[int]], params) -> float:
    """Seconds of one ``generate`` call."""
    synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    synchronize()
    return time.perf_counter() - start


def repeat_stats(walls: list[float], output_tokens: int) -> dict:
    """Every timed call's output tok/s, slowest over fastest, and the first call's wall time over the second's."""
    stats = {"repeat": len(walls), "calls_output_tok_s": [output_tokens / s for s in walls], "calls_wall_s": walls,
             "slowest_over_fastest": max(walls) / min(walls)}
    if len(walls) > 1:
        stats["first_over_second"] = walls[0] / walls[1]
    return stats


def completions_of(prompts: list[list[int]], max_tokens: list[int], args) -> tuple[list[list[int]], list[int]]:
    """The workload as the sequences it decodes: with ``--n k`` each prompt's k completions count as
    k requests (their output tokens, and, for the limit, their reads of the prompt's K/V; its
    prefill is counted k times too, which lowers the limit with prefill a little)."""
    k = sampling(args).get("n", 1)
    return [p for p in prompts for _ in range(k)], [m for m in max_tokens for _ in range(k)]


def run_hookllm(path: Path, prompts, max_tokens, enforce_eager: bool, args) -> tuple[dict, object]:
    """``args.repeat`` timed calls of the workload on one engine; the row's rates are the median call's."""
    from hookllm import SamplingParams
    from hookllm.kernels import compiled_triton_variants

    name = "hookllm" + (" eager" if enforce_eager else "")
    llm, startup = start_llm(path, args, 2048 + 64, enforce_eager)
    params = [SamplingParams(ignore_eos=True, max_tokens=n, **sampling(args)) for n in max_tokens]
    counted_prompts, counted_tokens = completions_of(prompts, max_tokens, args)
    walls, compiled = [], []
    for i in range(args.repeat):
        llm.reset_prefix_cache()  # every call computes the same prompts from scratch, as the first does
        before = compiled_triton_variants()
        walls.append(timed_call(llm, prompts, params))
        compiled.append(compiled_triton_variants() - before)  # a compile in a timed call: a warm-up gap
        print(f"{name} call {i + 1}/{args.repeat}: {sum(counted_tokens) / walls[-1]:.0f} output tok/s, "
              f"{walls[-1]:.2f}s, {compiled[-1]} Triton variants compiled", flush=True)
    median = statistics.median_low(walls)  # of an even count, the faster middle call
    row = summarize(name if args.repeat == 1 else f"{name} median call", median, counted_prompts, counted_tokens)
    row.update(repeat_stats(walls, sum(counted_tokens)), calls_triton_variants_compiled=compiled)
    row["startup"] = {**startup, "first_call_s": walls[0]}
    row["kv_cache_tokens"] = llm.engine.engine_core.scheduler.block_manager.num_blocks * llm.engine.config.block_size
    return row, llm


def run_batch1_latency(path: Path, prompt: list[int], args) -> dict:
    """One request alone, ``args.repeat`` times: time to first token and decode time per output token,
    from the request's metrics (engine-side wall clock, as a streaming client would see them)."""
    from hookllm import SamplingParams

    llm, startup = start_llm(path, args, 4096)
    params = SamplingParams(**latency_sampling(args), ignore_eos=True, max_tokens=LATENCY_OUTPUT_TOKENS)
    calls = []
    for i in range(args.repeat):
        llm.reset_prefix_cache()  # the same prompt each call: no call may find it cached
        start = time.perf_counter()
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        e2e_s = time.perf_counter() - start
        m, decoded = output.metrics, len(output.outputs[0].token_ids) - 1
        calls.append({"ttft_ms": 1e3 * (m.first_token_time - m.arrival_time),
                      "tpot_ms": 1e3 * (m.last_token_time - m.first_token_time) / decoded, "e2e_ms": 1e3 * e2e_s})
        print(f"call {i + 1}/{args.repeat}: TTFT {calls[-1]['ttft_ms']:.1f} ms, TPOT {calls[-1]['tpot_ms']:.3f} ms, "
              f"end to end {calls[-1]['e2e_ms']:.0f} ms", flush=True)
    row = {key + "_p50": statistics.median(c[key] for c in calls) for key in ("ttft_ms", "tpot_ms", "e2e_ms")}
    row.update(calls=calls, startup={**startup, "first_call_s": calls[0]["e2e_ms"] / 1e3})
    return row


def run_latency(llm, prompts, max_tokens, rate: float, num_requests: int, params: dict) -> dict:
    """Workload B: Poisson arrivals in-process; TTFT and TPOT percentiles."""
    from hookllm import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()  # workload A ran these prompts: B must not find them cached
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
                               SamplingParams(ignore_eos=True, max_tokens=max_tokens[i], **params))
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
    """The transformers model of the checkpoint; of a config-only shape, random weights built on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not has_weights(path):
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(str(path), attn_implementation="sdpa")
        with torch.device("cuda"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, device_map="cuda",
                                                attn_implementation="sdpa").eval()


def timed_peer(name: str, run, prompts, max_tokens) -> dict:
    """Warm ``run(prompts, max_tokens)`` up on two short requests, then time it on the workload."""
    run(prompts[:2], [8, 8])
    synchronize()
    start = time.perf_counter()
    run(prompts, max_tokens)
    synchronize()
    return summarize(name, time.perf_counter() - start, prompts, max_tokens)


def run_transformers_cb(path: Path, prompts, max_tokens, params: dict) -> dict:
    from transformers import GenerationConfig

    model = load_transformers(path)
    config = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=True, eos_token_id=None, pad_token_id=0,
                              **params)

    def run(batch_prompts, batch_max):
        with model.continuous_batching_context_manager(generation_config=config) as manager:
            for i, (p, n) in enumerate(zip(batch_prompts, batch_max)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
            received = 0
            while received < len(batch_prompts):
                if manager.get_result(timeout=1) is not None:
                    received += 1

    return timed_peer("transformers_cb", run, prompts, max_tokens)


def run_transformers_static(path: Path, prompts, max_tokens, batch_size: int, params: dict) -> dict:
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
                           min_new_tokens=max(chunk_max), do_sample=True, eos_token_id=None, pad_token_id=0,
                           **params)

    return timed_peer("transformers_static", run, prompts, max_tokens)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def add_engine_arguments(parser) -> None:
    """The model (``--shape``, ``--tiny``, ``--root``) and the engine's batch limits, as
    ``checkpoint`` and ``engine_kwargs`` read them (with ``resolve_engine_arguments``)."""
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU (smoke test)")
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-cuda-graph-tokens", type=int, default=None)


def resolve_engine_arguments(args) -> None:
    """The native bf16 model (no other implementation or quantization) and the engine's own
    ``max_cuda_graph_tokens`` unless given."""
    args.model_impl, args.quantization, args.kv_cache_dtype = None, None, "auto"
    if args.max_cuda_graph_tokens is None:
        from hookllm.config import EngineConfig
        args.max_cuda_graph_tokens = EngineConfig.max_cuda_graph_tokens


def checkpoint(args) -> Path:
    """The saved random checkpoint of ``--shape``, or with ``--tiny`` a tiny random Llama."""
    if not args.tiny:
        return random_checkpoint(args.shape, Path(args.root))
    from hookllm import testing

    path = Path(args.root) / "tiny"
    if not (path / "config.json").exists():
        testing.build_tiny_checkpoint(testing.tiny_llama_config(max_position_embeddings=4096), path)
    return path


def run_throughput(path: Path, config: dict, weight_bytes: int, payload: dict, args) -> None:
    """Workload A or short: hookllm (``--repeat`` calls), workload B, the eager engine and, on A, the peers."""
    prompts, max_tokens = random_workload(args.workload, args.num_requests)
    prompts = [[t % config["vocab_size"] for t in p] for p in prompts]  # --tiny's vocabulary is small
    sequences = completions_of(prompts, max_tokens, args)
    limit = physical_limit(config, *sequences, weight_bytes, args.max_num_seqs, **limit_kwargs(args))
    bf16 = physical_limit(config, *sequences, weight_bytes, args.max_num_seqs)
    # The peers sample one completion per prompt: beside n > 1 they would time another workload.
    with_peers = args.workload == "a" and not args.tiny and sampling(args).get("n", 1) == 1
    n_peer = args.peer_requests or len(prompts)
    results: dict[str, dict] = {}
    payload.update(workload=describe(args.workload, len(prompts))
                   + (f"; peers on the first {n_peer}" if with_peers and n_peer != len(prompts) else ""),
                   results=results, physical_limit_output_tok_s=limit["output_tok_s"],
                   physical_limit_with_prefill_output_tok_s=limit["output_tok_s_with_prefill"],
                   physical_limit_bf16_output_tok_s=bf16["output_tok_s"],
                   physical_limit_bf16_with_prefill_output_tok_s=bf16["output_tok_s_with_prefill"],
                   physical_limit_inputs=limit)
    payload.update(sampling=sampling(args), peer_sampling=peer_sampling(args))
    name = (f"throughput-{payload['model']}" + ("" if args.workload == "a" else f"-{args.workload}")
            + sampling_suffix(args) + precision_suffix(args)
            + (f"-{args.distributed_executor_backend}" if args.distributed_executor_backend else ""))
    payload.update(distributed_executor_backend=args.distributed_executor_backend or "uni")

    def save() -> None:  # after every engine, so a run cut short keeps what it measured
        write_result(name, payload, args.out)

    results["hookllm"], llm = run_hookllm(path, prompts, max_tokens, False, args)
    save()
    if args.latency_rate:
        results["hookllm"]["latency"] = run_latency(llm, prompts, max_tokens, args.latency_rate, args.latency_requests,
                                                    sampling(args))
        save()
    del llm
    free_memory()
    if args.eager_too:
        results["hookllm_eager"], llm = run_hookllm(path, prompts, max_tokens, True, args)
        save()
        del llm
        free_memory()
    peers = [("transformers_cb", args.skip_cb, lambda: run_transformers_cb(path, prompts[:n_peer], max_tokens[:n_peer],
                                                                               peer_sampling(args))),
             ("transformers_static", args.skip_static,
              lambda: run_transformers_static(path, prompts[:n_peer], max_tokens[:n_peer], args.static_batch_size,
                                              peer_sampling(args)))]
    for peer, skip, run in peers:
        if skip or not with_peers:
            continue
        try:
            results[peer] = run()
        except Exception as exc:  # a peer's failure is reported, never hides hookllm's numbers
            results[peer] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{peer} failed: {results[peer]['error']}", flush=True)
        save()
        free_memory()
    ours = results["hookllm"]
    print(f"\n{payload['model']} on {payload['device']} ({payload['commit']}), workload {payload['workload']}")
    print(f"physical limit {limit['output_tok_s']:.0f} tok/s decoding only (steps x weight bytes + KV bytes at "
          f"{HBM_BYTES_PER_S:.2g} B/s), {limit['output_tok_s_with_prefill']:.0f} tok/s with the prompts' "
          f"{limit['prefill_flops']:.3g} FLOPs at {BF16_FLOP_PER_S:.3g} FLOP/s"
          + (f" ({limit['fp8_prefill_flops']:.3g} of them at {FP8_FLOP_PER_S:.3g})" if limit["fp8_prefill_flops"]
             else ""))
    if precision(args):
        print(f"with {precision_suffix(args)[1:]}: bf16 limit {bf16['output_tok_s']:.0f} tok/s decoding only, "
              f"{bf16['output_tok_s_with_prefill']:.0f} tok/s with prefill")
    print_engine_table(results, [("out tok/s", "output_tok_s", ".0f"), ("total tok/s", "total_tok_s", ".0f"),
                                 ("req/s", "requests_s", ".2f"), ("wall s", "wall_s", ".1f")])
    print(f"hookllm reaches {ours['output_tok_s'] / limit['output_tok_s']:.1%} of the decode limit and "
          f"{ours['output_tok_s'] / limit['output_tok_s_with_prefill']:.1%} of the limit with prefill; "
          f"KV cache {ours['kv_cache_tokens']} tokens")
    if args.repeat > 1:
        print(f"{args.repeat} calls: " + ", ".join(f"{r:.0f}" for r in ours["calls_output_tok_s"])
              + f" tok/s; slowest / fastest {ours['slowest_over_fastest']:.3f}, "
              f"first / second (wall) {ours['first_over_second']:.3f}")
    print_startup(ours["startup"])
    if "latency" in ours:
        print("latency:", {k: round(v, 2) for k, v in ours["latency"].items()})


def latency_sampling(args) -> dict:
    """The latency workload's sampling: greedy, unless sampling options are given (then
    temperature 0.6 and those, as the throughput workloads sample)."""
    chosen = sampling(args)
    return chosen if len(chosen) > 1 else {"temperature": 0.0}


def run_latency_workload(path: Path, config: dict, weight_bytes: int, payload: dict, args) -> None:
    """Workload latency: batch-1 TTFT and TPOT beside their limits."""
    prompt = [t % config["vocab_size"] for t in latency_prompt()]
    limit = physical_limit(config, [prompt], [LATENCY_OUTPUT_TOKENS], weight_bytes, **limit_kwargs(args))
    limits, bf16 = latency_limits(limit), latency_limits(physical_limit(config, [prompt], [LATENCY_OUTPUT_TOKENS],
                                                                         weight_bytes))
    payload.update(workload=f"latency: one request, {LATENCY_PROMPT_TOKENS}-token prompt, {LATENCY_OUTPUT_TOKENS} "
                            f"output tokens ({latency_sampling(args)}), ignore_eos, {args.repeat} calls",
                   limits=limits, limits_bf16=bf16, limit_inputs=limit)
    payload["results"] = row = run_batch1_latency(path, prompt, args)
    write_result(f"latency-{payload['model']}{precision_suffix(args)}{sampling_suffix(args)}", payload, args.out)
    print(f"\n{payload['model']} on {payload['device']} ({payload['commit']}), {payload['workload']}")
    print(f"{'':<26}{'measured p50':>14}{'limit':>10}{'share':>8}{'bf16 limit':>12}")
    for key, label in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token")):
        measured = row[key + "_p50"]
        print(f"{label + ' ms':<26}{measured:>14.3f}{limits[key]:>10.3f}{limits[key] / measured:>8.1%}"
              f"{bf16[key]:>12.3f}")
    print_startup(row["startup"])


def latency_limits(limit: dict) -> dict:
    """TTFT: the prompt's FLOPs at their rates; a decode step: the weights and the request's K/V at HBM speed."""
    return {"ttft_ms": 1e3 * limit["prefill_s"],
            "tpot_ms": 1e3 * limit["bytes_read"] / limit["decode_steps"] / HBM_BYTES_PER_S}


def print_startup(startup: dict) -> None:
    print(f"start-up: LLM() {startup['llm_init_s']:.1f}s, warm-up call {startup['warmup_s']:.1f}s, "
          f"first timed call {startup['first_call_s']:.2f}s")


def main() -> None:
    from hookllm.config import EngineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama on the CPU (smoke test)")
    parser.add_argument("--root", default="/tmp/hookllm-bench")
    parser.add_argument("--workload", default="a", choices=[*WORKLOADS, "latency"])
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed calls on one engine after its warm-up (default 1; 5 for --workload latency)")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 256 for A, 2048 for short")
    parser.add_argument("--peer-requests", type=int, default=None,
                        help="run the transformers peers on only the first N requests (device time)")
    parser.add_argument("--model-impl", default=None, choices=["native", "transformers"],
                        help="the model's implementation (default: the engine's choice, native where one exists)")
    parser.add_argument("--skip-cb", action="store_true")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp"],
                        help="mp: the model worker in a process of its own (default: the engine's process)")
    parser.add_argument("--eager-too", action="store_true", help="also time hookllm with enforce_eager")
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-cuda-graph-tokens", type=int, default=EngineConfig.max_cuda_graph_tokens,
                        help="the engine option: steps with prefill up to this many tokens as CUDA graphs "
                             "(0: eagerly; default: the engine's)")
    parser.add_argument("--latency-rate", type=float, default=0.0, help="workload B arrival rate (0: skip)")
    parser.add_argument("--latency-requests", type=int, default=128)
    add_sampling_arguments(parser)
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="the engine option: fp8 quantizes the linear layers at load (default: bf16)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the engine option: fp8 stores K/V in e4m3 (default: auto, the model dtype)")
    add_out_argument(parser)
    args = parser.parse_args()
    args.repeat = args.repeat or (5 if args.workload == "latency" else 1)

    path = checkpoint(args)
    config = json.loads((path / "config.json").read_text())
    weight_bytes = (sum(f.stat().st_size for f in path.glob("*.safetensors")) if has_weights(path)
                    else config_weight_bytes(config))
    payload = {"device": device_name(), "date": now(), "commit": commit(), "workload_name": args.workload,
               "model": "tiny" if args.tiny else args.shape, "max_cuda_graph_tokens": args.max_cuda_graph_tokens,
               "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    run = run_latency_workload if args.workload == "latency" else run_throughput
    run(path, config, weight_bytes, payload, args)


if __name__ == "__main__":
    main()
