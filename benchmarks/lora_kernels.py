"""The multi-LoRA kernels alone (needs a CUDA GPU): ``lora_shrink`` and ``lora_expand`` on each
projection of the Llama shapes, against the bytes they must move.

For ``llama-3.2-1b`` and ``llama-3.1-8b`` (benchmarks/common.py), the four LoRA'd projections of a
decoder layer: ``qkv`` (three slices), ``o``, ``gate_up`` (two slices) and ``down``, with random
bf16 adapters of rank R in L slots, at M rows of random bf16 activations, either all in slot 0
(``one``) or dealt round-robin over the L slots in shuffled order (``spread``). Timed as a step
runs them: ``--layers`` copies of the projection (each its own adapters, activations and output,
as consecutive decoder layers have), called one after the other in one CUDA graph, the median
replay (``triton.testing.do_bench``, which clears the L2 cache first) divided by the copies: the
shrink, the expand (into the layer's output), both in a row, and both in a step where no row has
an adapter (``idle``: the programs return at once).

The floor: the bytes that must move at the card's HBM rate (``gpu_rates`` in common.py). Shrink:
the A of the slots with tokens, ``x`` and the shrunk ``[M, N]`` float32 written once; expand: the B
of those slots, the shrunk read once and ``y`` read and written; both: the sum. Checked first on
every projection (spread, 64 rows): the kernels against the torch reference in float32 (relative
error below 1e-2). ``--sweep`` also times each kernel at every combination of a few values of its
launch parameters and prints the best against the default's.

    python benchmarks/lora_kernels.py [--models llama-3.2-1b,llama-3.1-8b] [--rows 1,64,256] [--rank 16] [--slots 8]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from common import (HBM_BYTES_PER_S, SHAPES, add_out_argument, commit, device_name, head_dim, now,  # noqa: E402
                    write_result)

from hookllm.kernels import reference, triton_lora  # noqa: E402
from hookllm.kernels.triton_lora import ExpandConfig, ShrinkConfig  # noqa: E402

MODELS = ("llama-3.2-1b", "llama-3.1-8b")
ROWS = "1,64,256"
LAYERS = 8
SPREADS = ("one", "spread")
OPS = ("shrink", "expand", "both")
# --sweep: every combination of these launch parameters, per kernel.
SHRINK_SWEEP = dict(block_m=(16, 32), block_k=(64, 128), splits=(4, 8, 16, 32), num_warps=(4,), num_stages=(3,))
EXPAND_SWEEP = dict(block_m=(16, 32, 64), block_n=(128,), blocks_per_program=(1, 2, 4, 8), num_warps=(4,),
                    num_stages=(2, 3))


def projections(model: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """(K, output widths of the slices) of each projection of one decoder layer."""
    config = SHAPES[model]
    h, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * head_dim(config), config["num_key_value_heads"] * head_dim(config)
    return {"qkv": (h, (q, kv, kv)), "o": (q, (h,)), "gate_up": (h, (inter, inter)), "down": (inter, (h,))}


class Projection:
    """One projection's adapters in every slot, in each of ``layers`` copies: A ``[L, slices * R, K]``,
    B ``[L, OUT, R]``, bf16."""

    def __init__(self, model: str, name: str, k: int, widths: tuple[int, ...], rank: int, slots: int, layers: int):
        self.model, self.name, self.k, self.rank, self.slots, self.layers = model, name, k, rank, slots, layers
        self.slice_starts = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
        self.n, self.out = len(widths) * rank, self.slice_starts[-1]
        generator = torch.Generator("cuda").manual_seed(k + self.out)
        self.lora_a = [(k ** -0.5) * torch.randn(slots, self.n, k, device="cuda", generator=generator,
                                                 dtype=torch.bfloat16) for _ in range(layers)]
        self.lora_b = [(rank ** -0.5) * torch.randn(slots, self.out, rank, device="cuda", generator=generator,
                                                    dtype=torch.bfloat16) for _ in range(layers)]

    def batch(self, rows: int, spread: str) -> dict:
        """Each copy's activations and output, and the slot grouping of ``rows`` tokens."""
        generator = torch.Generator("cuda").manual_seed(rows)
        used = self.slots if spread == "spread" else 1
        slot_of = torch.arange(rows, device="cuda") % used
        order = torch.randperm(rows, device="cuda", generator=generator)
        order = order[torch.argsort(slot_of[order], stable=True)].to(torch.int32)
        counts = torch.zeros(self.slots, dtype=torch.int32, device="cuda")
        counts[:used] = torch.bincount(slot_of, minlength=used).to(torch.int32)
        starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
        return dict(x=[torch.randn(rows, self.k, device="cuda", generator=generator, dtype=torch.bfloat16)
                       for _ in range(self.layers)],
                    y=[torch.randn(rows, self.out, device="cuda", generator=generator, dtype=torch.bfloat16)
                       for _ in range(self.layers)],
                    grouping=(order, starts, counts), used=min(used, rows))

    def calls(self, batch: dict, shrink: ShrinkConfig | None = None, expand: ExpandConfig | None = None) -> dict:
        """Each timed op over every copy of ``batch`` as a function of nothing, at the given configs
        (default: the engine's)."""
        xs, ys, grouping = batch["x"], batch["y"], batch["grouping"]
        default_shrink, default_expand = self.configs(xs[0].shape[0])
        shrink, expand = shrink or default_shrink, expand or default_expand

        def run_shrink() -> list[torch.Tensor]:
            return [triton_lora.lora_shrink_with(x, a, *grouping, shrink) for x, a in zip(xs, self.lora_a)]

        def run_expand(shrunk: list[torch.Tensor]) -> None:
            for y, h, b in zip(ys, shrunk, self.lora_b):
                triton_lora.lora_expand_with(y, h, b, self.slice_starts, *grouping, expand)

        shrunk = run_shrink()
        return {"shrink": run_shrink, "expand": lambda: run_expand(shrunk), "both": lambda: run_expand(run_shrink())}

    def widths(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in zip(self.slice_starts, self.slice_starts[1:]))

    def configs(self, rows: int) -> tuple[ShrinkConfig, ExpandConfig]:
        """The launch parameters ``lora_shrink`` and ``lora_expand`` pick for ``rows`` rows on this GPU."""
        shrink = triton_lora.shrink_config(rows, self.n, self.k, sm_count())
        return shrink, triton_lora.expand_config(rows, self.widths(), self.rank, shrink.splits, sm_count())

    def check(self, rows: int = 64) -> float:
        """||triton - reference|| / ||reference delta|| of shrink then expand (spread), the reference in float32."""
        batch = self.batch(rows, "spread")
        x, y, grouping, lora_a, lora_b = batch["x"][0], batch["y"][0], batch["grouping"], self.lora_a[0], self.lora_b[0]
        got = y.clone()
        triton_lora.lora_expand(got, triton_lora.lora_shrink(x, lora_a, *grouping), lora_b, self.slice_starts,
                                *grouping)
        want = y.float()
        reference.lora_expand(want, reference.lora_shrink(x.float(), lora_a.float(), *grouping), lora_b.float(),
                              self.slice_starts, *grouping)
        return float((got.float() - want).norm() / (want - y.float()).norm())

    def floor_us(self, rows: int, used: int) -> dict[str, float]:
        """Each op's bytes at HBM speed: the adapters of the ``used`` slots, activations once."""
        shrunk = 4 * rows * self.n
        shrink = 2 * (used * self.n * self.k + rows * self.k) + shrunk
        expand = 2 * (used * self.out * self.rank + 2 * rows * self.out) + shrunk
        return {"shrink": 1e6 * shrink / HBM_BYTES_PER_S, "expand": 1e6 * expand / HBM_BYTES_PER_S,
                "both": 1e6 * (shrink + expand) / HBM_BYTES_PER_S}


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def median_us(fn, layers: int, rep: int = 50) -> float:
    """Median µs per layer of ``fn`` (a call on each of ``layers`` copies) captured in a CUDA graph
    and replayed: neither the host's launches nor the graph's own launch are in the number."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=max(5, rep // 4), rep=rep,
                                         return_mode="median") / layers


def measure(projection: Projection, rows: int, spread: str) -> dict:
    batch = projection.batch(rows, spread)
    floor = projection.floor_us(rows, batch["used"])
    row = {"model": projection.model, "projection": projection.name, "rows": rows, "spread": spread,
           "slots_used": batch["used"], "k": projection.k, "n": projection.n, "out": projection.out,
           **{f"{op}_config": config.__dict__ for op, config in zip(("shrink", "expand"), projection.configs(rows))}}
    for op, fn in projection.calls(batch).items():
        us = median_us(fn, projection.layers)
        row[op] = {"us": us, "floor_us": floor[op], "of_floor": floor[op] / us}
    batch["grouping"][2].zero_()  # a step in which no row has an adapter: every program returns at once
    row["idle_us"] = median_us(projection.calls(batch)["both"], projection.layers)
    return row


def sweep(projection: Projection, rows: int, spread: str) -> dict:
    """Each kernel's time at the default config and at every candidate's."""
    batch = projection.batch(rows, spread)
    defaults = dict(zip(("shrink", "expand"), projection.configs(rows)))
    result = {"model": projection.model, "projection": projection.name, "rows": rows, "spread": spread}
    for op, grid in (("shrink", SHRINK_SWEEP), ("expand", EXPAND_SWEEP)):
        default = defaults[op]
        config_type = type(default)
        candidates = {default} | {config_type(*values) for values in itertools.product(*grid.values())}
        times = {}
        for config in candidates:
            try:
                times[config] = median_us(projection.calls(batch, **{op: config})[op], projection.layers, rep=20)
            except triton.runtime.errors.OutOfResources:
                continue  # tiles past the shared memory
        best = min(times, key=times.get)
        result[op] = {"default": default.__dict__, "default_us": times[default], "best": best.__dict__,
                      "best_us": times[best], "us": {"-".join(map(str, c.__dict__.values())): t
                                                     for c, t in times.items()}}
        print(f"sweep {projection.model} {projection.name} M={rows} {spread} {op}: best "
              f"{tuple(best.__dict__.values())} {times[best]:.1f} us, default {tuple(default.__dict__.values())} "
              f"{times[default]:.1f} us", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--projections", default="qkv,o,gate_up,down")
    parser.add_argument("--rows", default=ROWS, help="row counts M (tokens per call)")
    parser.add_argument("--spreads", default=",".join(SPREADS), help="one: every row in slot 0; spread: over all slots")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="adapter slots L")
    parser.add_argument("--layers", type=int, default=LAYERS, help="copies of each projection called in a row")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate launch config")
    add_out_argument(parser)
    args = parser.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    spreads = args.spreads.split(",")
    layers = [Projection(model, name, k, widths, args.rank, args.slots, args.layers)
              for model in args.models.split(",") for name, (k, widths) in projections(model).items()
              if name in args.projections.split(",")]
    checks = {}
    for layer in layers:
        checks[f"{layer.model}/{layer.name}"] = error = layer.check()
        print(f"{layer.model} {layer.name} (K={layer.k}, OUT={layer.out}): relative error vs reference {error:.1e}",
              flush=True)
        assert error < 1e-2, f"{layer.model} {layer.name}: relative error {error}"
    results = [measure(layer, m, spread) for layer in layers for m in rows for spread in spreads]
    sweeps = [sweep(layer, m, spread) for layer in layers for m in rows for spread in spreads] if args.sweep else []
    payload = {"device": device_name(), "date": now(), "commit": commit(), "rank": args.rank, "slots": args.slots,
               "checks": checks, "results": results, "sweep": sweeps, "hbm_bytes_per_s": HBM_BYTES_PER_S}
    subset = "" if args.rows == ROWS else "-m" + args.rows.replace(",", "-")  # a split run keeps its own file
    write_result(f"lora-kernels-{'sweep-' if sweeps else ''}r{args.rank}-{payload['commit']}{subset}", payload,
                 args.out)
    print(f"\nLoRA kernels on {payload['device']} ({payload['commit']}), R={args.rank}, L={args.slots}; "
          f"floor: bytes at {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    print(f"{'model':<14}{'proj':<9}{'rows':>5}{'spread':>8}" + "".join(f"{op + ' us':>11}{'floor':>7}{'%':>5}"
                                                                       for op in OPS) + f"{'idle us':>9}")
    for r in results:
        cells = "".join(f"{r[op]['us']:>11.1f}{r[op]['floor_us']:>7.1f}{100 * r[op]['of_floor']:>5.0f}" for op in OPS)
        print(f"{r['model']:<14}{r['projection']:<9}{r['rows']:>5}{r['spread']:>8}{cells}{r['idle_us']:>9.1f}")
    for s in sweeps:
        print(f"sweep {s['model']:<14}{s['projection']:<9}M={s['rows']:<4}{s['spread']:<7}"
              + "".join(f" {op} best {tuple(s[op]['best'].values())} {s[op]['best_us']:.1f} us "
                        f"(default {s[op]['default_us']:.1f})" for op in ("shrink", "expand")))


if __name__ == "__main__":
    main()
