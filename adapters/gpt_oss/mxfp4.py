"""gpt-oss's MXFP4 expert checkpoints, dequantized at load.

The hub's gpt-oss checkpoints (``quantization_config.quant_method == "mxfp4"``) store each
layer's expert matrices as OCP microscaling FP4: ``...experts.<proj>_blocks`` (uint8
``[experts, rows, cols / 32, 16]``: 32 e2m1 values per block, two per byte, the low nibble the
earlier column) and ``...experts.<proj>_scales`` (uint8 ``[experts, rows, cols / 32]``: one E8M0
exponent per block, scale ``2 ** (s - 127)``). ``rows`` are the output features (``2 * inter``
for ``gate_up_proj``, gate and up alternating; ``hidden`` for ``down_proj``), ``cols`` the inputs.
Biases are stored unquantized.

:class:`Mxfp4Method` serves them on the quantization contract (hookllm.plugins.quantization).
hookllm has no FP4 matmul: :func:`dequantize_experts` turns each pair back into the bf16
checkpoint's tensor (``[experts, cols, rows]``, i.e. transposed), which
:class:`hookllm.layers.fused_moe.FusedMoE`'s stacked loader then slices for this rank. Every
e2m1 value times a power of two is exact in bf16 (and fp32) unless it under- or overflows, so
nothing is rounded on the way.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from hookllm.layers.linear import LoadedWeight, loaded_shape, materialize
from hookllm.plugins.quantization import QuantizationMethod

# e2m1: sign bit, 2 exponent bits, 1 mantissa bit; code 8 is -0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale
E8M0_BIAS = 127
SUFFIXES = ("_blocks", "_scales")
CHUNK_VALUES = 1 << 24  # dequantized values per step (bounds the temporaries, see dequantize_mxfp4)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     what: str = "mxfp4 tensor") -> torch.Tensor:
    """``blocks`` uint8 ``[..., rows, groups, 16]`` and ``scales`` uint8 ``[..., rows, groups]`` ->
    ``[..., rows, groups * 32]`` in ``dtype`` (on ``blocks``' device).

    A few million values at a time: the int64 lookup indices are 16 bytes per byte of FP4, so
    one gpt-oss-120b layer's gate_up_proj in one go would need about 17 GB of them."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"{what}: blocks shape {tuple(blocks.shape)} does not end in {BLOCK // 2} bytes "
                         f"({BLOCK} FP4 values) per block")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{what}: scales shape {tuple(scales.shape)} != blocks shape without its last "
                         f"dim {tuple(blocks.shape[:-1])} (one scale per {BLOCK}-value block)")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    groups = blocks.shape[-2]
    flat_blocks, flat_scales = blocks.reshape(-1, groups, BLOCK // 2), scales.reshape(-1, groups)
    out = torch.empty(flat_scales.shape[0], groups, BLOCK, dtype=dtype, device=blocks.device)
    step = max(1, CHUNK_VALUES // (groups * BLOCK))
    for start in range(0, flat_scales.shape[0], step):
        block = flat_blocks[start:start + step]
        # Interleave the nibbles: the low one holds the earlier of the byte's two values.
        values = torch.stack([lut[(block & 0x0F).long()], lut[(block >> 4).long()]], dim=-1).flatten(-2)
        # E8M0 is a bare exponent; ldexp scales by it exactly (no 2**e rounding in a small dtype).
        exponent = flat_scales[start:start + step].to(torch.int32) - E8M0_BIAS
        out[start:start + step] = torch.ldexp(values, exponent[..., None]).to(dtype)
    return out.reshape(*blocks.shape[:-2], groups * BLOCK)


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, expected_rows_cols: tuple[int, int, int],
                       dtype: torch.dtype, name: str) -> torch.Tensor:
    """One projection's ``[experts, rows, cols]`` MXFP4 pair as the bf16 checkpoint's tensor:
    ``[experts, cols, rows]`` (a transposed view of the dequantized values)."""
    experts, rows, cols = expected_rows_cols
    if cols % BLOCK:
        raise ValueError(f"{name}: {cols} input features are not a multiple of the MXFP4 block ({BLOCK})")
    want_blocks, want_scales = (experts, rows, cols // BLOCK, BLOCK // 2), (experts, rows, cols // BLOCK)
    if tuple(blocks.shape) != want_blocks:
        raise ValueError(f"{name}_blocks: checkpoint shape {tuple(blocks.shape)} != expected {want_blocks}")
    if tuple(scales.shape) != want_scales:
        raise ValueError(f"{name}_scales: checkpoint shape {tuple(scales.shape)} != expected {want_scales}")
    return dequantize_mxfp4(blocks, scales, dtype, name).transpose(1, 2)


def dequantized_weights(weights: Iterable[tuple[str, LoadedWeight]], shapes: dict[str, tuple[int, int, int]],
                        dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, LoadedWeight]]:
    """``weights`` with each ``<name>_blocks`` / ``<name>_scales`` pair replaced by ``<name>``,
    dequantized (on ``device``, in ``dtype``); everything else passes through untouched.

    ``shapes`` maps every quantized parameter name to its ``(experts, rows, cols)``. A pair may
    be split over safetensors shards: the first half waits (read into memory, since a lazy
    slice dies with the next item) until its partner arrives. A name ``shapes`` lacks, or a half
    whose partner never comes, is a ``ValueError``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        if base not in shapes:
            raise ValueError(f"checkpoint tensor {name} ({loaded_shape(tensor)}): no MXFP4-quantized "
                             "parameter of this model has that name")
        halves = pending.setdefault(base, {})
        halves[suffix] = materialize(tensor).to(device)
        if len(halves) == len(SUFFIXES):
            del pending[base]
            yield base, dequantize_experts(halves["_blocks"], halves["_scales"], shapes[base], dtype, base)
    if pending:
        lonely = ", ".join(f"{base}{next(iter(halves))} (no {base}{next(s for s in SUFFIXES if s not in halves)})"
                           for base, halves in sorted(pending.items()))
        raise ValueError(f"incomplete MXFP4 tensors: {lonely}")


class Mxfp4Method(QuantizationMethod):
    """``quant_method: mxfp4`` (the hub's gpt-oss checkpoints), served on the quantization
    contract: each expert pair is dequantized as it streams past, so the layers load bf16
    tensors; nothing else is quantized."""

    name = "mxfp4"

    def __init__(self, quantization_config: dict[str, Any], model_config: Any):
        super().__init__(quantization_config, model_config)
        if model_config.architecture != "GptOssForCausalLM":
            raise ValueError(f"mxfp4 is served for gpt-oss's experts only, not {model_config.architecture}")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, LoadedWeight]],
                           model: nn.Module) -> Iterator[tuple[str, LoadedWeight]]:
        experts = model.model.layers[0].mlp.experts.gate_up_proj
        return dequantized_weights(weights, model.mxfp4_shapes(), experts.dtype, experts.device)

    def describe(self) -> str:
        return "mxfp4 experts dequantized to the model dtype at load (no FP4 matmul)"
