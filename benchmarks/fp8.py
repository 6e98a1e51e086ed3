"""The FP8 GEMMs alone (needs a CUDA GPU with FP8 tensor cores: Hopper, Ada): each linear layer
of the Llama shapes at decode and prefill row counts, bf16 against e4m3, and a sweep of block sizes.

For ``llama-3.2-1b`` and ``llama-3.1-8b`` (benchmarks/common.py), the four matmuls of a decoder
layer (``qkv``, ``o``, ``gate_up``, ``down``) with random bf16 weights quantized per output channel,
at M rows of random bf16 activations. Timed (median of ``triton.testing.do_bench``, which clears
the L2 cache between calls, of the call captured in a CUDA graph, as the engine replays a step):

* ``bf16``: ``torch.nn.functional.linear``;
* ``w8a8``: Triton ``quantize_fp8(x, K)`` (per-token scales) + the Triton GEMM (``scaled_matmul_with``
  at ``default_config``; the engine's ``scaled_matmul`` uses it below 65 rows, cuBLASLt from 65);
* ``torch``: the same quantization + ``torch._scaled_mm`` with row-wise scales (cuBLASLt); an error
  is recorded, not raised, where torch refuses the shape;
* ``weight_only``: Triton ``scaled_matmul`` of bf16 activations by the e4m3 weights.

Reported: µs, GB/s of the bytes that must move (weights at their dtype, bf16 activations in and
out), TFLOP/s (``2 M N K``) and the speed-up over bf16. Checked once per layer: the Triton kernels
against ``reference.scaled_matmul`` on the same e4m3 operands (max abs difference over the
reference's max abs value, below 1e-2). ``--sweep`` times every candidate ``MatmulConfig`` on the
W8A8 matmul of all eight layers per row count and prints the best (summed over the layers) against
``default_config``; ``--split-sweep`` times each layer's W8A8 matmul at ``default_config``'s
blocks with every split-K count (decode row counts) and prints the best against the default's.

    python benchmarks/fp8.py [--models llama-3.2-1b,llama-3.1-8b] [--rows 1,16,64,...] [--sweep] [--split-sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from common import (BF16_FLOP_PER_S, FP8_FLOP_PER_S, HBM_BYTES_PER_S, SHAPES, add_out_argument, commit,  # noqa: E402
                    device_name, head_dim, now, write_result)

from hookllm.kernels import reference, triton_fp8  # noqa: E402
from hookllm.kernels.triton_fp8 import MatmulConfig  # noqa: E402

MODELS = ("llama-3.2-1b", "llama-3.1-8b")
ROWS = "1,16,64,128,256,512,2048,8192"
KERNELS = ("bf16", "w8a8", "torch", "weight_only")
# (block_m, block_n, block_k, num_warps, num_stages) tried by --sweep, block_m capped by the rows.
SPLITS = (1, 2, 4, 8, 16)
CANDIDATES = [MatmulConfig(*c) for c in itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), (4, 8),
                                                          (3, 4, 5))]


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each matmul of one decoder layer: outputs by inputs."""
    config = SHAPES[model]
    h, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * head_dim(config), config["num_key_value_heads"] * head_dim(config)
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


class Layer:
    """One linear layer: random bf16 weights and their e4m3 copy with per-channel scales."""

    def __init__(self, model: str, name: str, n: int, k: int):
        self.model, self.name, self.n, self.k = model, name, n, k
        generator = torch.Generator("cuda").manual_seed(n * 7 + k)
        self.w = (k ** -0.5) * torch.randn(n, k, device="cuda", generator=generator, dtype=torch.bfloat16)
        self.wq, self.ws = triton_fp8.quantize_fp8(self.w, k)  # scale [N, 1]

    def inputs(self, rows: int) -> torch.Tensor:
        generator = torch.Generator("cuda").manual_seed(rows)
        return torch.randn(rows, self.k, device="cuda", generator=generator, dtype=torch.bfloat16)

    def calls(self, x: torch.Tensor) -> dict:
        """Each kernel's call on ``x``, as a function of nothing."""
        config = default_config(len(x), self)

        def w8a8():  # the Triton kernel at every row count (scaled_matmul hands large ones to cuBLASLt)
            q, s = triton_fp8.quantize_fp8(x, self.k)
            return triton_fp8.scaled_matmul_with(q, s, self.wq, self.ws, torch.bfloat16, None, config)

        def scaled_mm():
            q, s = triton_fp8.quantize_fp8(x, self.k)
            return torch._scaled_mm(q, self.wq.t(), scale_a=s, scale_b=self.ws.view(1, -1), out_dtype=torch.bfloat16)

        return {"bf16": lambda: torch.nn.functional.linear(x, self.w), "w8a8": w8a8, "torch": scaled_mm,
                "weight_only": lambda: triton_fp8.scaled_matmul(x, None, self.wq, self.ws, torch.bfloat16)}

    def check(self, rows: int = 128) -> dict:
        """max |triton - reference| / max |reference| of W8A8 and weight-only on the same e4m3 operands."""
        x = self.inputs(rows)
        q, s = triton_fp8.quantize_fp8(x, self.k)
        errors = {}
        for name, a, a_scale in (("w8a8", q, s), ("weight_only", x, None)):
            ref = reference.scaled_matmul(a, a_scale, self.wq, self.ws, torch.float32)
            out = triton_fp8.scaled_matmul_with(a, a_scale, self.wq, self.ws, torch.bfloat16, None,
                                                default_config(rows, self)).float()
            errors[name] = float((out - ref).abs().max() / ref.abs().max())
        return errors

    def moved_bytes(self, rows: int, weight_bytes: int) -> int:
        return weight_bytes * self.n * self.k + 2 * rows * (self.k + self.n)


def default_config(rows: int, layer: Layer) -> MatmulConfig:
    """The engine's configuration for ``layer`` at ``rows`` rows on this GPU (split-K included)."""
    return triton_fp8.default_config(rows, layer.n, layer.k, torch.cuda.get_device_properties(0).multi_processor_count)


def median_ms(fn, rep: int = 100) -> float:
    """Median ms of ``fn`` captured in a CUDA graph and replayed (the host's launches are out of the number)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=max(10, rep // 4), rep=rep, return_mode="median")


def measure(layer: Layer, rows: int) -> dict:
    x = layer.inputs(rows)
    flops = 2.0 * rows * layer.n * layer.k
    row = {"model": layer.model, "layer": layer.name, "m": rows, "n": layer.n, "k": layer.k,
           "default": default_config(rows, layer).__dict__}
    for name, fn in layer.calls(x).items():
        try:
            ms = median_ms(fn)
        except Exception as exc:  # torch._scaled_mm refuses some shapes and devices
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        moved = layer.moved_bytes(rows, 2 if name == "bf16" else 1)
        row[name] = {"us": 1e3 * ms, "gb_s": moved / (ms / 1e3) / 1e9, "tflop_s": flops / (ms / 1e3) / 1e12}
    for name in KERNELS[1:]:
        if "us" in row[name] and "us" in row["bf16"]:
            row[name]["speedup"] = row["bf16"]["us"] / row[name]["us"]
    fp8_floor = max(layer.moved_bytes(rows, 1) / HBM_BYTES_PER_S, flops / FP8_FLOP_PER_S)
    row["floor_us"] = {"bf16": 1e6 * max(layer.moved_bytes(rows, 2) / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S),
                       "fp8": 1e6 * fp8_floor}
    return row


def sweep(layers: list[Layer], rows: int) -> dict:
    """Sum over ``layers`` of the W8A8 matmul's time (activations quantized beforehand) per candidate."""
    operands = [(layer, *triton_fp8.quantize_fp8(layer.inputs(rows), layer.k)) for layer in layers]

    def total_ms(config: MatmulConfig) -> float:
        return sum(median_ms(lambda: triton_fp8.scaled_matmul_with(q, s, layer.wq, layer.ws, torch.bfloat16, None,
                                                                   config), rep=25)
                   for layer, q, s in operands)

    default = triton_fp8.default_config(rows)
    times = {default: total_ms(default)}
    for config in CANDIDATES:
        if config in times or config.block_m > max(16, rows) or (rows >= 1024 and config.block_m < 64):
            continue  # rows past the matrix (padding only), or small tiles on prefill-sized matrices
        try:
            times[config] = total_ms(config)
        except triton.runtime.errors.OutOfResources:
            continue  # tiles past the shared memory
    best = min(times, key=times.get)
    print(f"sweep M={rows}: best {tuple(best.__dict__.values())} {1e3 * times[best]:.1f} us, default "
          f"{tuple(default.__dict__.values())} {1e3 * times[default]:.1f} us ({len(times)} configs)", flush=True)
    return {"m": rows, "best": best.__dict__, "best_us": 1e3 * times[best], "default": default.__dict__,
            "default_us": 1e3 * times[default], "default_over_best": times[default] / times[best],
            "sweep_us": {"-".join(map(str, c.__dict__.values())): 1e3 * t for c, t in times.items()}}


def split_sweep(layer: Layer, rows: int) -> dict:
    """The W8A8 matmul of ``layer`` (activations quantized beforehand) at each split-K count."""
    q, s = triton_fp8.quantize_fp8(layer.inputs(rows), layer.k)
    default = default_config(rows, layer)
    times = {split: 1e3 * median_ms(lambda: triton_fp8.scaled_matmul_with(
        q, s, layer.wq, layer.ws, torch.bfloat16, None, dataclasses.replace(default, split_k=split)), rep=50)
        for split in SPLITS}
    best = min(times, key=times.get)
    print(f"split sweep {layer.model} {layer.name} M={rows}: best split {best} {times[best]:.1f} us, default "
          f"{default.split_k} {times[default.split_k]:.1f} us", flush=True)
    return {"model": layer.model, "layer": layer.name, "m": rows, "n": layer.n, "k": layer.k, "best": best,
            "default": default.split_k, "us_by_split": times}


def cell(entry: dict, key: str, spec: str) -> str:
    return f"{entry[key]:>{spec}}" if key in entry else f"{'err':>{spec.split('.')[0]}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rows", default=ROWS, help="row counts M (tokens per call)")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate MatmulConfig per row count")
    parser.add_argument("--sweep-only", action="store_true", help="the sweep without the timings of the four kernels")
    parser.add_argument("--split-sweep", action="store_true", help="also time each layer at every split-K count")
    add_out_argument(parser)
    args = parser.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    layers = [Layer(model, name, n, k) for model in args.models.split(",")
              for name, (n, k) in layer_shapes(model).items()]
    checks = {}
    for layer in layers:
        checks[f"{layer.model}/{layer.name}"] = errors = layer.check()
        print(f"{layer.model} {layer.name} (N={layer.n}, K={layer.k}): max abs diff / max abs vs reference "
              + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
        assert all(v < 1e-2 for v in errors.values()), f"{layer.model} {layer.name}: {errors}"
    results = [] if args.sweep_only else [measure(layer, m) for layer in layers for m in rows]
    sweeps = [sweep(layers, m) for m in rows] if args.sweep or args.sweep_only else []
    splits = [split_sweep(layer, m) for layer in layers for m in rows if m < triton_fp8.CUBLAS_FROM_ROWS] \
        if args.split_sweep else []
    payload = {"device": device_name(), "date": now(), "commit": commit(), "checks": checks, "results": results,
               "sweep": sweeps, "split_sweep": splits, "hbm_bytes_per_s": HBM_BYTES_PER_S,
               "bf16_flop_per_s": BF16_FLOP_PER_S, "fp8_flop_per_s": FP8_FLOP_PER_S}
    subset = "" if args.rows == ROWS else "-m" + args.rows.replace(",", "-")  # a split run keeps its own file
    write_result(f"fp8-gemm-{'sweep-' if sweeps else ''}{payload['commit']}{subset}", payload, args.out)
    print(f"\nFP8 GEMMs on {payload['device']} ({payload['commit']}); us, speed-up over bf16")
    print(f"{'model':<14}{'layer':<9}{'M':>6}{'bf16':>9}{'w8a8':>9}{'x':>6}{'torch':>9}{'x':>6}{'w-only':>9}{'x':>6}"
          f"{'w8a8 GB/s':>11}{'TFLOP/s':>9}")
    for r in results:
        b, w, t, o = (r[k] for k in KERNELS)
        print(f"{r['model']:<14}{r['layer']:<9}{r['m']:>6}{cell(b, 'us', '9.1f')}{cell(w, 'us', '9.1f')}"
              f"{cell(w, 'speedup', '6.2f')}{cell(t, 'us', '9.1f')}{cell(t, 'speedup', '6.2f')}{cell(o, 'us', '9.1f')}"
              f"{cell(o, 'speedup', '6.2f')}{cell(w, 'gb_s', '11.0f')}{cell(w, 'tflop_s', '9.0f')}")
    for s in sweeps:
        print(f"sweep M={s['m']:<5} best {tuple(s['best'].values())} {s['best_us']:.1f} us; default "
              f"{tuple(s['default'].values())} {s['default_us']:.1f} us ({s['default_over_best']:.2f}x)")
    for s in splits:
        times = s["us_by_split"]
        print(f"split M={s['m']:<3} {s['model']:<14}{s['layer']:<9} best {s['best']:>2} ({times[s['best']]:.1f} us), "
              f"default {s['default']:>2} ({times[s['default']]:.1f} us)")


if __name__ == "__main__":
    main()
