"""Batch-1 matmuls on one GPU: the matrix-vector kernel (``hookllm.kernels.triton_matvec``) against
``F.linear`` (cuBLAS) on the weight matrices of the 1B and 8B shapes, in bf16.

One row times each matrix: GPU time per call (``triton.testing.do_bench``, L2 flushed between
calls, as in a decode step, which streams every matrix once) and the share of 4.3 TB/s that
reading the matrix once in that time is.

    python benchmarks/matvec.py [--tune]

``--tune`` also times other tile shapes (rows per program, columns per tile, warps). Writes JSON
to benchmarks/results/matvec.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from hookllm.kernels import triton_matvec

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, add_out_argument, commit, device_name, now, write_result  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
TILES = list(itertools.product((4, 8, 16), (256, 512, 1024), (4, 8)))  # --tune: (rows, cols, warps)


def matrices(shape: str) -> dict[str, tuple[int, int]]:
    """(outputs, inputs) of each of a layer's matrices and of the LM head."""
    c = SHAPES[shape]
    h, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    return {"qkv": (qkv, h), "o": (h, c["num_attention_heads"] * head_dim), "gate_up": (2 * inter, h),
            "down": (h, inter), "lm_head": (c["vocab_size"], h)}


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def with_tile(rows: int, cols: int, warps: int, fn):
    saved = triton_matvec.MATVEC_ROWS, triton_matvec.MATVEC_COLS, triton_matvec.MATVEC_WARPS
    triton_matvec.MATVEC_ROWS, triton_matvec.MATVEC_COLS, triton_matvec.MATVEC_WARPS = rows, cols, warps
    try:
        return fn()
    finally:
        triton_matvec.MATVEC_ROWS, triton_matvec.MATVEC_COLS, triton_matvec.MATVEC_WARPS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--tune", action="store_true")
    add_out_argument(parser)
    args = parser.parse_args()
    rows = []
    print(f"{'shape':<14}{'matrix':<9}{'N x K':>16}{'cuBLAS ms':>11}{'kernel ms':>11}{'cuBLAS BW':>11}{'kernel BW':>11}")
    for shape in args.shapes.split(","):
        for name, (n, k) in matrices(shape).items():
            x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
            torch.testing.assert_close(triton_matvec.matvec(x, w), F.linear(x, w), rtol=2e-2, atol=2e-2)
            nbytes = n * k * 2
            row = dict(shape=shape, matrix=name, n=n, k=k, bytes=nbytes, cublas_ms=time_ms(lambda: F.linear(x, w)),
                       kernel_ms=time_ms(lambda: triton_matvec.matvec(x, w)))
            if args.tune:
                row["tiles"] = [dict(rows=r, cols=c, warps=wp, ms=with_tile(r, c, wp, lambda: time_ms(
                    lambda: triton_matvec.matvec(x, w)))) for r, c, wp in TILES]
            rows.append(row)
            share = lambda ms: nbytes / (ms * 1e-3) / HBM_BYTES_PER_S  # noqa: E731
            print(f"{shape:<14}{name:<9}{f'{n} x {k}':>16}{row['cublas_ms']:>11.4f}{row['kernel_ms']:>11.4f}"
                  f"{share(row['cublas_ms']):>11.1%}{share(row['kernel_ms']):>11.1%}")
            if args.tune:
                best = min(row["tiles"], key=lambda t: t["ms"])
                print(f"    best tile: {best['rows']} rows x {best['cols']} cols, {best['warps']} warps: "
                      f"{best['ms']:.4f} ms ({share(best['ms']):.1%})")
    totals = {shape: (sum(r["cublas_ms"] for r in rows if r["shape"] == shape),
                      sum(r["kernel_ms"] for r in rows if r["shape"] == shape)) for shape in args.shapes.split(",")}
    for shape, (cublas, kernel) in totals.items():
        print(f"{shape}: one layer + LM head, cuBLAS {cublas:.3f} ms, kernel {kernel:.3f} ms")
    write_result("matvec", {"device": device_name(), "date": now(), "commit": commit(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
