"""Benchmark of the sampler's kernels on one GPU: each row's top-k / top-p / min-p threshold
(``filter_thresholds``, the Triton kernel next to its torch reference), the sampling pass that
applies it, and the penalty stage, on float32 logits of a Llama-3 vocabulary (128,256).

Logits are random normal, scaled to two shapes of distribution: ``peaked`` (x 4, most mass on
a few hundred tokens, as a trained model's) and ``flat`` (x 0.5, a random-weight model's: a
top-p nucleus of most of the vocabulary). Times are GPU times per call (``triton.testing.do_bench``,
L2 flushed between calls).

    python benchmarks/sampling.py [--rows 1 64 256] [--tune]

It also times ``token_logprobs`` (the chosen tokens' logprobs and ranks, and the top 0, 1, 5 or
20) against its torch reference. ``--tune`` also times the filter kernel with other lane counts
and warps, and the sampling kernel with other column ranges per SM, warps and tile widths
(checking it picks the same tokens). Writes JSON to benchmarks/results/sampling.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

from hookllm.kernels import reference, triton_ops

sys.path.insert(0, str(Path(__file__).parent))
from common import add_out_argument, commit, device_name, now, write_result  # noqa: E402

VOCAB = 128256
SPREADS = {"peaked": 4.0, "flat": 0.5}
FILTERS = {  # name: (top_k, top_p, min_p)
    "min_p 0.05": (0, 1.0, 0.05),
    "top_k 50": (50, 1.0, 0.0),
    "top_p 0.9 + top_k 50": (50, 0.9, 0.0),
    "top_p 0.95": (0, 0.95, 0.0),
    "top_p 0.5": (0, 0.5, 0.0),
}


def filter_args(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple:
    """``filter_thresholds``' arguments for every row asking for the same filters, at temperature 0.8."""
    rows = logits.shape[0]
    full = lambda value, dtype=torch.float32: torch.full((rows,), value, dtype=dtype, device=logits.device)  # noqa: E731
    needed = VOCAB if top_p < 1.0 and top_k <= 0 else top_k
    return (logits, full(0.8), full(top_k, torch.long), full(top_p), full(min_p), needed, top_p < 1.0)


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def filter_rows(rows: int, spread: float) -> list[dict]:
    logits = torch.randn(rows, VOCAB, device="cuda") * spread
    keys = torch.randint(0, 2**32, (rows,), device="cuda")
    temperature = torch.full((rows,), 0.8, device="cuda")
    results = [dict(filters="temperature only", triton_ms=0.0, torch_ms=0.0,
                    sample_ms=time_ms(lambda: triton_ops.sample_with_hashed_noise(logits, temperature, keys)))]
    for name, (top_k, top_p, min_p) in FILTERS.items():
        args = filter_args(logits, top_k, top_p, min_p)
        threshold = triton_ops.filter_thresholds(*args)
        expected = reference.filter_thresholds(*args)
        same = torch.equal(logits >= threshold[:, None], logits >= expected[:, None])
        results.append(dict(
            filters=name, same_as_torch=same,
            kept=float((logits >= threshold[:, None]).sum(dim=1).float().mean()),
            triton_ms=time_ms(lambda: triton_ops.filter_thresholds(*args)),
            torch_ms=time_ms(lambda: reference.filter_thresholds(*args)),
            sample_ms=time_ms(lambda: triton_ops.sample_with_hashed_noise(logits, temperature, keys, threshold))))
    return results


def penalty_row(rows: int) -> dict:
    slots = rows
    logits = torch.randn(rows, VOCAB, device="cuda")
    tables = (torch.zeros(slots, VOCAB, device="cuda"),
              torch.randint(0, 3, (slots, VOCAB), device="cuda", dtype=torch.int32),
              torch.rand(slots, VOCAB, device="cuda") < 0.01,
              torch.tensor([0.5, 0.5, 1.1], device="cuda").repeat(slots, 1))
    index = torch.arange(rows, device="cuda")
    return dict(rows=rows,
                triton_ms=time_ms(lambda: triton_ops.apply_penalties(logits, index, index, *tables)),
                torch_ms=time_ms(lambda: reference.apply_penalties(logits, index, index, *tables)))


def logprobs_rows(rows: int, spread: float) -> list[dict]:
    """``token_logprobs`` (the chosen tokens' logprobs and ranks, and the top n) against torch's."""
    logits = torch.randn(rows, VOCAB, device="cuda") * spread
    token_ids = torch.randint(0, VOCAB, (rows,), device="cuda")
    results = []
    for num_top in (0, 1, 5, 20):
        got = triton_ops.token_logprobs(logits, token_ids, num_top)
        want = reference.token_logprobs(logits, token_ids, num_top)
        results.append(dict(
            num_top=num_top, same_ids=torch.equal(got[3], want[3]) and torch.equal(got[1], want[1]),
            max_error=max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(got[::2], want[::2])),
            triton_ms=time_ms(lambda: triton_ops.token_logprobs(logits, token_ids, num_top)),
            torch_ms=time_ms(lambda: reference.token_logprobs(logits, token_ids, num_top))))
    return results


def tune(rows: int) -> list[dict]:
    """The filter kernel's time with other lane counts and warps, for every filter on both logits shapes."""
    cases = {f"{name}, {spread_name}": filter_args(torch.randn(rows, VOCAB, device="cuda") * spread, *FILTERS[name])
             for spread_name, spread in SPREADS.items() for name in FILTERS}
    chosen = triton_ops.FILTER_LANES, triton_ops.FILTER_WARPS
    results = []
    for lanes in (1024, 2048):
        for warps in (4, 8, 16):
            triton_ops.FILTER_LANES, triton_ops.FILTER_WARPS = lanes, warps
            results.append(dict(lanes=lanes, warps=warps, **{name: time_ms(lambda: triton_ops.filter_thresholds(*args))
                                                            for name, args in cases.items()}))
    triton_ops.FILTER_LANES, triton_ops.FILTER_WARPS = chosen
    return results


def tune_sampler(rows_list: list[int]) -> list[dict]:
    """The sampling kernel's time (temperature only, flat logits) by programs per SM, warps and
    tile width, at each row count; ``same`` says whether it drew the default settings' tokens."""
    chosen = triton_ops.SAMPLER_PROGRAMS_PER_SM, triton_ops.SAMPLER_WARPS, triton_ops.SAMPLER_BLOCK
    results = []
    for rows in rows_list:
        logits = torch.randn(rows, VOCAB, device="cuda") * SPREADS["flat"]
        keys = torch.randint(0, 2**32, (rows,), device="cuda")
        temperature = torch.full((rows,), 0.8, device="cuda")
        expected = triton_ops.sample_with_hashed_noise(logits, temperature, keys)
        for per_sm in (2, 4, 8, 16):
            for warps in (4, 8):
                for block in (1024, 2048, 4096):
                    triton_ops.SAMPLER_PROGRAMS_PER_SM, triton_ops.SAMPLER_WARPS, triton_ops.SAMPLER_BLOCK = (
                        per_sm, warps, block)
                    same = torch.equal(triton_ops.sample_with_hashed_noise(logits, temperature, keys), expected)
                    results.append(dict(rows=rows, programs_per_sm=per_sm, warps=warps, block=block, same=same,
                                        sample_ms=time_ms(lambda: triton_ops.sample_with_hashed_noise(
                                            logits, temperature, keys))))
        triton_ops.SAMPLER_PROGRAMS_PER_SM, triton_ops.SAMPLER_WARPS, triton_ops.SAMPLER_BLOCK = chosen
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--tune", action="store_true")
    add_out_argument(parser)
    args = parser.parse_args()
    payload = dict(device=device_name(), commit=commit(), date=now(), vocab=VOCAB, filters={}, logprobs={},
                   penalties=[])
    for rows in args.rows:
        for spread_name, spread in SPREADS.items():
            payload["filters"][f"{rows}-{spread_name}"] = filter_rows(rows, spread)
            payload["logprobs"][f"{rows}-{spread_name}"] = logprobs_rows(rows, spread)
        payload["penalties"].append(penalty_row(rows))
    print(f"{'rows':>5} {'logits':>7} {'filters':<22} {'triton ms':>10} {'torch ms':>9} {'sample ms':>10} {'kept':>8}  same")
    for case, measured in payload["filters"].items():
        rows, spread_name = case.split("-")
        for m in measured:
            print(f"{rows:>5} {spread_name:>7} {m['filters']:<22} {m['triton_ms']:>10.3f} {m['torch_ms']:>9.3f} "
                  f"{m['sample_ms']:>10.3f} {m.get('kept', VOCAB):>8.0f}  {m.get('same_as_torch', '')}")
    print(f"\n{'case':>13} {'logprobs':>9} {'triton ms':>10} {'torch ms':>9}  same ids, max error")
    for case, measured in payload["logprobs"].items():
        print("\n".join(f"{case:>13} {m['num_top']:>9} {m['triton_ms']:>10.3f} {m['torch_ms']:>9.3f}  "
                        f"{m['same_ids']}, {m['max_error']:.1e}" for m in measured))
    print(f"\n{'rows':>5} {'penalties: triton ms':>21} {'torch ms':>9}")
    for m in payload["penalties"]:
        print(f"{m['rows']:>5} {m['triton_ms']:>21.3f} {m['torch_ms']:>9.3f}")
    if args.tune:
        payload["tune"] = tune(max(args.rows))
        print(f"\nfilter kernel at {max(args.rows)} rows (ms):")
        for m in payload["tune"]:
            print(f"  lanes {m['lanes']:>5} warps {m['warps']:>3}: " +
                  ", ".join(f"{name} {ms:.3f}" for name, ms in m.items() if name not in ("lanes", "warps")))
        payload["tune_sampler"] = tune_sampler(args.rows)
        print("\nsampling kernel, temperature only (ms), fastest five per row count:")
        for rows in args.rows:
            measured = sorted((m for m in payload["tune_sampler"] if m["rows"] == rows), key=lambda m: m["sample_ms"])
            default = next(m for m in measured if (m["programs_per_sm"], m["warps"], m["block"]) == (
                triton_ops.SAMPLER_PROGRAMS_PER_SM, triton_ops.SAMPLER_WARPS, triton_ops.SAMPLER_BLOCK))
            print(f"  {rows} rows: default {default['sample_ms']:.4f}; " + ", ".join(
                f"{m['programs_per_sm']}/sm x{m['warps']}w x{m['block']} {m['sample_ms']:.4f}{'' if m['same'] else ' DIFFERENT'}"
                for m in measured[:5]))
    print("wrote", write_result("sampling", payload, args.out))


if __name__ == "__main__":
    main()
