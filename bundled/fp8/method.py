"""The ``fp8`` and ``compressed-tensors`` quantization methods and their linear layers.

Numeric paths, chosen once per model from the device and logged (``describe``):

- ``w8a8`` (CUDA with FP8 tensor cores, compute capability 8.9+): activations quantized to e4m3
  when the step runs (per token, per token and group, or with the static scale), then an FP8
  GEMM (:mod:`hookllm.kernels.triton_fp8`);
- ``weight-only`` (older GPUs, and weight-only checkpoints everywhere): activations stay in the
  model dtype; each e4m3 weight tile is converted inside the GEMM;
- on the CPU the torch references (:mod:`hookllm.kernels.reference`) compute either with the
  same numerics, so tests check the GPU's path.

MoE experts (``FusedMoE``) are e4m3 weights run weight-only on every device: the fused MoE
kernels convert each weight tile in registers (:mod:`hookllm.kernels.triton_moe`); experts'
static activation scales are then not used.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from hookllm.kernels import ops_for
from hookllm.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, to_fp8
from hookllm.layers.attention import Attention
from hookllm.layers.linear import VECTOR_LAYOUT, LoadedWeight, ParamLayout, _ShardedLinear, materialize
from hookllm.bundled.fp8.scheme import Fp8Scheme, compressed_tensors_scheme, hf_fp8_scheme
from hookllm.plugins.quantization import LinearMethod, MoeMethod, QuantizationMethod

# A fused layer's checkpoint projections: it is left unquantized only if all of them are.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
logger = logging.getLogger(__name__)

# Per-layer KV-cache scales: ``<attention>.k_scale`` (compressed-tensors), or the older
# ``<attention>.k_proj.output_scale``.
KV_SCALE = re.compile(r"(?P<attention>.+)\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.output_scale)")
# An expert's static activation scale, which the weight-only experts do not use.
EXPERT_INPUT_SCALE = re.compile(r".+\.experts\.\d+\.\w+\.input_scale")
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _parameter(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, layout: ParamLayout | None = None,
               fill: float | None = None, device: torch.device | None = None) -> nn.Parameter:
    data = (torch.empty(shape, dtype=dtype, device=device) if fill is None
            else torch.full(shape, fill, dtype=dtype, device=device))
    param = nn.Parameter(data, requires_grad=False)
    if layout is not None:
        param.param_layout = layout
    return param


def _scale_layout(scheme: Fp8Scheme) -> ParamLayout:
    """How a weight scale lies in the checkpoint: per block, per tensor (filled into the shard's
    rows, so fused shards keep their own), or per row."""
    if scheme.weight_strategy == "block":
        return ParamLayout(out_block=scheme.block[0], in_block=scheme.block[1])
    if scheme.weight_strategy == "tensor":
        return ParamLayout(("out",), scalar_fill=True)
    return VECTOR_LAYOUT


def _scale_groups(scheme: Fp8Scheme, cols: int, what: str) -> int:
    """Scale groups along ``cols`` input columns: one, or one per block (whole blocks only)."""
    if scheme.weight_strategy != "block":
        return 1
    groups = -(-cols // scheme.block[1])
    if groups > 1 and cols % scheme.block[1]:
        raise ValueError(f"{what}: {cols} input columns are not whole blocks of {scheme.block[1]}")
    return groups


def _row_scales(weight: torch.Tensor) -> torch.Tensor:
    """Per-row scales of ``weight``'s last dim, for quantizing at load."""
    return (weight.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=FP8_MIN_SCALE)


def numeric_path(device: torch.device, scheme: Fp8Scheme) -> str:
    """``w8a8`` or ``weight-only`` (see the module's docstring)."""
    if scheme.activations == "none":
        return "weight-only"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "weight-only"
    return "w8a8"


class Fp8LinearMethod(LinearMethod):
    """One linear layer's e4m3 weight ``[out, in]`` with float32 scales ``[out, groups]`` (one
    group per output channel, or one per block of columns), and how its input is scaled."""

    def __init__(self, scheme: Fp8Scheme, path: str):
        self.scheme, self.path = scheme, path

    def create_weights(self, layer: _ShardedLinear) -> None:
        scheme = self.scheme
        if scheme.quantize_at_load:
            return  # the model-dtype weight loads as it is, then process_weights_after_loading
        rows, cols = layer.weight.shape
        layer.weight = _parameter((rows, cols), FP8_DTYPE)
        groups = _scale_groups(scheme, cols, type(layer).__name__)
        layer.register_parameter(scheme.scale_name, _parameter((rows, groups), layout=_scale_layout(scheme)))
        if scheme.activations == "static":
            layer.input_scale = _parameter((1,), layout=ParamLayout((), reduce_max=True), fill=0.0)

    def process_weights_after_loading(self, layer: _ShardedLinear) -> None:
        if not self.scheme.quantize_at_load:
            return
        weight = layer.weight.data
        scale = _row_scales(weight)
        layer.weight = _parameter(tuple(weight.shape), FP8_DTYPE, device=weight.device)
        layer.weight.data.copy_(to_fp8(weight, scale))
        layer.register_parameter(self.scheme.scale_name, nn.Parameter(scale, requires_grad=False))

    def apply(self, layer: _ShardedLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ops = ops_for(x)
        rows = x.reshape(-1, x.shape[-1])
        weight_scale = getattr(layer, self.scheme.scale_name)
        if self.path == "weight-only":
            out = ops.scaled_matmul(rows, None, layer.weight, weight_scale, x.dtype, bias)
        else:
            if self.scheme.activations == "static":
                quantized, scale = to_fp8(rows, layer.input_scale), layer.input_scale.view(1, 1).expand(len(rows), 1)
            else:
                group = self.scheme.block[1] if self.scheme.activations == "group" else rows.shape[1]
                quantized, scale = ops.quantize_fp8(rows, group)
            out = ops.scaled_matmul(quantized, scale, layer.weight, weight_scale, x.dtype, bias)
        return out.view(*x.shape[:-1], out.shape[-1])


class Fp8MoeMethod(MoeMethod):
    """One ``FusedMoE``'s experts as e4m3 ``gate_up_proj`` / ``down_proj`` with float32 scales
    ``[experts, rows, groups]`` (``gate_up_proj_scale`` / ``down_proj_scale``), run weight-only."""

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    def create_weights(self, layer: nn.Module) -> None:
        if self.scheme.quantize_at_load:
            return
        for name, cols in zip(EXPERT_WEIGHTS, (layer.hidden_size, layer.local_inter)):
            weight = getattr(layer, name)
            setattr(layer, name, _parameter(tuple(weight.shape), FP8_DTYPE, device=weight.device))
            groups = _scale_groups(self.scheme, cols, f"experts' {name}")
            setattr(layer, f"{name}_scale", _parameter((weight.shape[0], weight.shape[1], groups),
                                                       layout=_scale_layout(self.scheme), device=weight.device))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.scheme.quantize_at_load:
            return
        for name in EXPERT_WEIGHTS:
            weight = getattr(layer, name).data
            quantized = _parameter(tuple(weight.shape), FP8_DTYPE, device=weight.device)
            scale = torch.empty((*weight.shape[:2], 1), dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):  # one expert at a time: no float32 copy of them all
                scale[expert] = _row_scales(weight[expert])
                quantized.data[expert] = to_fp8(weight[expert], scale[expert])
            setattr(layer, name, quantized)
            setattr(layer, f"{name}_scale", nn.Parameter(scale, requires_grad=False))


class Fp8Method(QuantizationMethod):
    """``quant_method: fp8`` checkpoints, and ``--quantization fp8`` on any other."""

    name = "fp8"

    def __init__(self, quantization_config: dict[str, Any], model_config: Any):
        super().__init__(quantization_config, model_config)
        self.scheme = self.read_scheme(quantization_config)
        self.path: str | None = None  # known once the first layer is on its device
        self.num_quantized = self.num_kept = self.num_moe = 0

    def read_scheme(self, quantization_config: dict[str, Any]) -> Fp8Scheme:
        return hf_fp8_scheme(quantization_config)

    def _ignored(self, prefix: str) -> bool:
        """Whether the checkpoint leaves the layer at ``prefix`` unquantized (a fused layer: all
        of its projections, or a ``ValueError`` when only some are)."""
        base, _, leaf = prefix.rpartition(".")
        parts = [f"{base}.{part}" for part in FUSED_PARTS.get(leaf, ())] or [prefix]
        ignored = [self.scheme.ignored(part) or self.scheme.ignored(prefix) for part in parts]
        if any(ignored) and not all(ignored):
            raise ValueError(f"{prefix}: the checkpoint quantizes some of {', '.join(parts)} but not all; "
                             "hookllm fuses them into one layer")
        return all(ignored)

    def linear_method(self, prefix: str, layer: _ShardedLinear) -> LinearMethod | None:
        if self._ignored(prefix):
            self.num_kept += 1
            return None
        self.path = self.path or numeric_path(layer.weight.device, self.scheme)
        self.num_quantized += 1
        return Fp8LinearMethod(self.scheme, self.path)

    def moe_method(self, prefix: str, layer: nn.Module) -> Fp8MoeMethod | None:
        if self.scheme.ignored(prefix):
            self.num_kept += 1
            return None
        self.num_moe += 1
        return Fp8MoeMethod(self.scheme)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, LoadedWeight]],
                           model: nn.Module) -> Iterator[tuple[str, LoadedWeight]]:
        """Per-layer K/V scales go to the attention layers (used by an FP8 KV cache)."""
        attention = {path.rpartition(".")[0]: m for path, m in model.named_modules() if isinstance(m, Attention)}
        unused = 0
        for name, tensor in weights:
            if EXPERT_INPUT_SCALE.fullmatch(name):
                unused += 1
                continue
            match = KV_SCALE.fullmatch(name)
            layer = attention.get(match["attention"]) if match else None
            if layer is None:
                yield name, tensor
                continue
            value = materialize(tensor).float()
            if value.numel() != 1:
                raise ValueError(f"checkpoint tensor {name}: a KV-cache scale must be one value, got shape "
                                 f"{tuple(value.shape)}")
            setattr(layer, f"{match['kv'] or match['proj']}_scale", float(value.reshape(())))
        if unused:
            logger.info("fp8: %d experts' static activation scales unused (experts run weight-only)", unused)

    def describe(self) -> str:
        kept = f", {self.num_kept} layers kept in the model dtype" if self.num_kept else ""
        moe = f", {self.num_moe} MoE layers' experts weight-only" if self.num_moe else ""
        return (f"{self.name}: {self.scheme.describe()}; {self.num_quantized} linear layers on the {self.path} "
                f"path{moe}{kept}")


class CompressedTensorsMethod(Fp8Method):
    """``quant_method: compressed-tensors`` checkpoints of FP8 weights."""

    name = "compressed-tensors"

    def read_scheme(self, quantization_config: dict[str, Any]) -> Fp8Scheme:
        if not quantization_config:
            raise ValueError("compressed-tensors is a checkpoint format: the checkpoint has no quantization_config "
                             "(--quantization fp8 quantizes an unquantized one)")
        return compressed_tensors_scheme(quantization_config)
