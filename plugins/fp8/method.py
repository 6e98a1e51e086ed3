"""The ``fp8`` and ``compressed-tensors`` quantization methods and their linear layers.

Numeric paths, chosen once per model from the device and logged (``describe``):

- ``w8a8`` (CUDA with FP8 tensor cores, compute capability 8.9+): activations quantized to e4m3
  when the step runs (per token, per token and group, or with the static scale), then an FP8
  GEMM (:mod:`hookllm.kernels.triton_fp8`);
- ``weight-only`` (older GPUs, and weight-only checkpoints everywhere): activations stay in the
  model dtype; each e4m3 weight tile is converted inside the GEMM;
- on the CPU the torch references (:mod:`hookllm.kernels.reference`) compute either with the
  same numerics, so tests check the GPU's path.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from hookllm.kernels import ops_for
from hookllm.kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, to_fp8
from hookllm.layers.attention import Attention
from hookllm.layers.linear import VECTOR_LAYOUT, LoadedWeight, ParamLayout, _ShardedLinear, materialize
from hookllm.plugins.fp8.scheme import Fp8Scheme, compressed_tensors_scheme, hf_fp8_scheme
from hookllm.plugins.quantization import LinearMethod, QuantizationMethod

# A fused layer's checkpoint projections: it is left unquantized only if all of them are.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Per-layer KV-cache scales: ``<attention>.k_scale`` (compressed-tensors), or the older
# ``<attention>.k_proj.output_scale``.
KV_SCALE = re.compile(r"(?P<attention>.+)\.(?:(?P<kv>[kv])_scale|(?P<proj>[kv])_proj\.output_scale)")


def _parameter(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, layout: ParamLayout | None = None,
               fill: float | None = None, device: torch.device | None = None) -> nn.Parameter:
    data = (torch.empty(shape, dtype=dtype, device=device) if fill is None
            else torch.full(shape, fill, dtype=dtype, device=device))
    param = nn.Parameter(data, requires_grad=False)
    if layout is not None:
        param.param_layout = layout
    return param


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
        if scheme.weight_strategy == "block":
            block_rows, block_cols = scheme.block
            groups = -(-cols // block_cols)
            if groups > 1 and cols % block_cols:
                raise ValueError(f"{type(layer).__name__}: {cols} input columns are not whole blocks of {block_cols}")
            scale = _parameter((rows, groups), layout=ParamLayout(out_block=block_rows, in_block=block_cols))
        else:
            # Per-tensor scales become per-row ones: q, k and v keep their own without requantizing.
            layout = ParamLayout(("out",), scalar_fill=True) if scheme.weight_strategy == "tensor" else VECTOR_LAYOUT
            scale = _parameter((rows, 1), layout=layout)
        layer.register_parameter(scheme.scale_name, scale)
        if scheme.activations == "static":
            layer.input_scale = _parameter((1,), layout=ParamLayout((), reduce_max=True), fill=0.0)

    def process_weights_after_loading(self, layer: _ShardedLinear) -> None:
        if not self.scheme.quantize_at_load:
            return
        weight = layer.weight.data
        scale = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
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


class Fp8Method(QuantizationMethod):
    """``quant_method: fp8`` checkpoints, and ``--quantization fp8`` on any other."""

    name = "fp8"

    def __init__(self, quantization_config: dict[str, Any], model_config: Any):
        super().__init__(quantization_config, model_config)
        self.scheme = self.read_scheme(quantization_config)
        self.path: str | None = None  # known once the first layer is on its device
        self.num_quantized = self.num_kept = 0

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

    def moe_method(self, prefix: str, layer: nn.Module) -> None:
        if not self.scheme.quantize_at_load:
            raise ValueError(f"{prefix}: FP8 expert weights are not served yet (the fused MoE kernels read the "
                             "model dtype); use the checkpoint's bf16 variant, or it with --quantization fp8")
        self.num_kept += 1
        return None

    def checkpoint_tensors(self, weights: Iterable[tuple[str, LoadedWeight]],
                           model: nn.Module) -> Iterator[tuple[str, LoadedWeight]]:
        """Per-layer K/V scales go to the attention layers (used by an FP8 KV cache)."""
        attention = {path.rpartition(".")[0]: m for path, m in model.named_modules() if isinstance(m, Attention)}
        for name, tensor in weights:
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

    def describe(self) -> str:
        kept = f", {self.num_kept} layers kept in the model dtype" if self.num_kept else ""
        return f"{self.name}: {self.scheme.describe()}; {self.num_quantized} linear layers on the {self.path} path{kept}"


class CompressedTensorsMethod(Fp8Method):
    """``quant_method: compressed-tensors`` checkpoints of FP8 weights."""

    name = "compressed-tensors"

    def read_scheme(self, quantization_config: dict[str, Any]) -> Fp8Scheme:
        if not quantization_config:
            raise ValueError("compressed-tensors is a checkpoint format: the checkpoint has no quantization_config "
                             "(--quantization fp8 quantizes an unquantized one)")
        return compressed_tensors_scheme(quantization_config)
