"""The fused MoE Triton kernels alone (needs a CUDA GPU): correctness in bf16, speed against the
device's limits, and a sweep of block sizes.

For each MoE shape (``qwen3-30b-a3b``, ``gpt-oss-20b``, ``mixtral-8x7b`` of benchmarks/common.py)
and token count, random bf16 weights of one layer, random hidden states and router logits routed
as the model routes them. Checked: the Triton output against the torch reference in float32
(relative error ``|out - ref| / |ref|``), for the default block sizes and every swept one. Timed
(median of ``triton.testing.do_bench``): routing + alignment + both grouped GEMMs + the weighted
sum, i.e. one ``fused_moe`` call. Reported against the device's limits: the bytes that must
move (the weights of the experts the batch touches, read once, plus activations) at HBM speed,
and the FLOPs (``2 * pairs * 3 * hidden * inter``) at the dense bf16 rate; the larger is the floor.

    python benchmarks/moe.py [--shapes qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b] [--tokens 1,64,256,2048] [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from common import (BF16_FLOP_PER_S, HBM_BYTES_PER_S, SHAPES, add_out_argument, commit, device_name,  # noqa: E402
                    moe_experts, now, write_result)

from hookllm.kernels import reference, triton_moe  # noqa: E402
from hookllm.kernels.triton_moe import MoeConfig  # noqa: E402

MOE_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b")
# (block_m, block_n, block_k, num_warps, num_stages) tried by --sweep.
CANDIDATES = [MoeConfig(*c) for c in (
    (16, 64, 64, 4, 3), (16, 64, 128, 4, 4), (16, 128, 64, 4, 3), (16, 128, 128, 4, 4),
    (32, 64, 64, 4, 3), (32, 64, 128, 4, 4), (32, 128, 64, 4, 3), (32, 128, 128, 8, 3),
    (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4), (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
)]


class Layer:
    """One MoE layer of a shape: random bf16 weights and how the model routes."""

    def __init__(self, shape: str):
        config = SHAPES[shape]
        self.shape = shape
        self.experts, self.top_k, self.inter = moe_experts(config)
        self.hidden = config["hidden_size"]
        gpt_oss = config["model_type"] == "gpt_oss"
        self.kwargs = dict(activation="swiglu_oai" if gpt_oss else "silu", swiglu_limit=7.0 if gpt_oss else None)
        self.softmax_first = not gpt_oss
        self.renormalize = config.get("norm_topk_prob", config["model_type"] == "mixtral")
        generator = torch.Generator("cuda").manual_seed(0)
        scale = self.hidden ** -0.5
        self.w_gate_up = scale * torch.randn(self.experts, 2 * self.inter, self.hidden, device="cuda",
                                             generator=generator, dtype=torch.bfloat16)
        self.w_down = (self.inter ** -0.5) * torch.randn(self.experts, self.hidden, self.inter, device="cuda",
                                                         generator=generator, dtype=torch.bfloat16)
        self.router = torch.randn(self.experts, self.hidden, device="cuda", generator=generator, dtype=torch.bfloat16)
        if gpt_oss:
            self.kwargs.update(
                gate_up_bias=0.1 * torch.randn(self.experts, 2 * self.inter, device="cuda", generator=generator,
                                               dtype=torch.bfloat16),
                down_bias=0.1 * torch.randn(self.experts, self.hidden, device="cuda", generator=generator,
                                            dtype=torch.bfloat16))

    def inputs(self, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator("cuda").manual_seed(seed)
        hidden = torch.randn(tokens, self.hidden, device="cuda", generator=generator, dtype=torch.bfloat16)
        return hidden, hidden @ self.router.T

    def run(self, hidden: torch.Tensor, logits: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
        weights, ids = triton_moe.route(logits, self.top_k, renormalize=self.renormalize,
                                        softmax_first=self.softmax_first)
        if config is None:
            return triton_moe.fused_moe(hidden, self.w_gate_up, self.w_down, weights, ids, **self.kwargs)
        return triton_moe.fused_moe_with(hidden, self.w_gate_up, self.w_down, weights, ids, config=config,
                                         gate_up_bias=self.kwargs.get("gate_up_bias"),
                                         down_bias=self.kwargs.get("down_bias"), activation=self.kwargs["activation"],
                                         swiglu_limit=self.kwargs["swiglu_limit"])

    def reference_fp32(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        weights, ids = reference.route(logits, self.top_k, renormalize=self.renormalize,
                                       softmax_first=self.softmax_first)
        f32 = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in self.kwargs.items()}
        return reference.fused_moe(hidden.float(), self.w_gate_up.float(), self.w_down.float(), weights, ids, **f32)

    def floor_s(self, logits: torch.Tensor) -> tuple[float, float, int]:
        """(bytes floor s, FLOPs floor s, experts touched) of one call."""
        _, ids = reference.route(logits, self.top_k, renormalize=self.renormalize, softmax_first=self.softmax_first)
        touched = int(torch.unique(ids).numel())
        tokens = logits.shape[0]
        weight_bytes = touched * 3 * self.hidden * self.inter * 2
        act_bytes = 2 * tokens * self.hidden * 2 + tokens * self.top_k * (3 * self.inter + self.hidden) * 2
        flops = 2.0 * tokens * self.top_k * 3 * self.hidden * self.inter
        return (weight_bytes + act_bytes) / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S, touched


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def median_ms(fn) -> float:
    """Median ms of ``fn`` captured in a CUDA graph and replayed, as the engine runs a step: the
    host's launch overhead (a dozen kernels) is out of the number."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def measure(layer: Layer, tokens: int, sweep: bool) -> dict:
    hidden, logits = layer.inputs(tokens, seed=tokens)
    ref = layer.reference_fp32(hidden, logits)
    out = layer.run(hidden, logits)
    error = rel_error(out, ref)
    assert torch.isfinite(out).all() and error < 2e-2, f"{layer.shape} T={tokens}: relative error {error:.3g}"
    bytes_s, flops_s, touched = layer.floor_s(logits)
    row = {"tokens": tokens, "experts_touched": touched, "rel_error": error,
           "floor_bytes_ms": 1e3 * bytes_s, "floor_flops_ms": 1e3 * flops_s,
           "default": triton_moe.default_config(tokens, layer.top_k, layer.experts).__dict__,
           "default_ms": median_ms(lambda: layer.run(hidden, logits))}
    if sweep:
        times = {}
        for config in CANDIDATES:
            if config.block_m > max(16, tokens * layer.top_k):
                continue  # rows per block past every expert's pairs: padding only
            try:
                swept = layer.run(hidden, logits, config)
            except triton.runtime.errors.OutOfResources:
                continue  # tiles past the shared memory (two weight tiles per stage in gate/up)
            swept_error = rel_error(swept, ref)
            assert swept_error < 2e-2, f"{layer.shape} T={tokens} {config}: relative error {swept_error:.3g}"
            times[config] = median_ms(lambda c=config: layer.run(hidden, logits, c))
        best = min(times, key=times.get)
        row.update(best=best.__dict__, best_ms=times[best],
                   sweep_ms={"-".join(map(str, c.__dict__.values())): t for c, t in times.items()})
    floor_ms = max(row["floor_bytes_ms"], row["floor_flops_ms"])
    ms = row.get("best_ms", row["default_ms"])
    row.update(floor_ms=floor_ms, share_of_floor=floor_ms / ms,
               gb_s=(row["floor_bytes_ms"] * HBM_BYTES_PER_S / 1e3) / (ms / 1e3) / 1e9,
               tflop_s=(row["floor_flops_ms"] * BF16_FLOP_PER_S / 1e3) / (ms / 1e3) / 1e12)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(MOE_SHAPES))
    parser.add_argument("--tokens", default="1,16,64,256,1024,2048,8192")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate block configuration")
    add_out_argument(parser)
    args = parser.parse_args()
    results = {}
    for shape in args.shapes.split(","):
        layer = Layer(shape)
        results[shape] = [measure(layer, int(t), args.sweep) for t in args.tokens.split(",")]
        del layer
        torch.cuda.empty_cache()
    payload = {"device": device_name(), "date": now(), "commit": commit(), "results": results,
               "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flop_per_s": BF16_FLOP_PER_S}
    write_result(f"moe-kernel-{'sweep-' if args.sweep else ''}{payload['commit']}", payload, args.out)
    print(f"\nfused MoE on {payload['device']} ({payload['commit']})")
    print(f"{'shape':<15}{'tokens':>7}{'experts':>8}{'rel err':>9}{'default ms':>11}{'best ms':>9}"
          f"{'floor ms':>9}{'of floor':>9}{'GB/s':>7}{'TFLOP/s':>8}  best (m,n,k,warps,stages)")
    for shape, rows in results.items():
        for r in rows:
            best = r.get("best")
            print(f"{shape:<15}{r['tokens']:>7}{r['experts_touched']:>8}{r['rel_error']:>9.1e}{r['default_ms']:>11.3f}"
                  f"{r.get('best_ms', float('nan')):>9.3f}{r['floor_ms']:>9.3f}{r['share_of_floor']:>9.1%}"
                  f"{r['gb_s']:>7.0f}{r['tflop_s']:>8.0f}  {tuple(best.values()) if best else ''}")


if __name__ == "__main__":
    main()
