"""What an FP8 checkpoint holds, read from its ``quantization_config``: :class:`Fp8Scheme`.

Three sources, one scheme each:

- Hugging Face's ``fp8`` method (``FineGrainedFP8Config``; Qwen3-*-FP8, DeepSeek-V3): e4m3
  ``weight`` and float32 ``weight_scale_inv`` per block of ``weight_block_size`` (128 x 128),
  activations quantized per token and group of ``block[1]`` columns, when the step runs.
- ``compressed-tensors`` FP8 (``float-quantized``, llm-compressor's; RedHatAI's Llama FP8):
  ``weight`` and ``weight_scale`` per tensor, per output channel or per block; activations per
  token (dynamic), one static ``input_scale`` per layer, or none (weight-only); optional
  per-layer K/V scales (``kv_cache_scheme``).
- ``--quantization fp8`` on a checkpoint without one: the weights load in the model dtype and
  are quantized per output channel once loaded; activations per token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

WEIGHT_STRATEGIES = ("tensor", "channel", "block")
# How the activations are scaled: per token, per token and group of weight-block columns,
# one static scale, or not at all (weight-only).
ACTIVATION_SCHEMES = ("token", "group", "static", "none")


@dataclass(frozen=True)
class Fp8Scheme:
    weight_strategy: str  # one of WEIGHT_STRATEGIES
    activations: str  # one of ACTIVATION_SCHEMES
    quantize_at_load: bool = False  # the checkpoint holds model-dtype weights
    block: tuple[int, int] | None = None  # (rows, columns) per weight scale, strategy "block"
    scale_name: str = "weight_scale"  # the checkpoint's name of the weight scale tensors
    kv_cache_scales: bool = False  # the checkpoint holds per-layer K and V scales
    ignored: Callable[[str], bool] = field(default=lambda name: False, compare=False)

    def describe(self) -> str:
        source = "quantized at load" if self.quantize_at_load else "from the checkpoint"
        weights = f"{self.block[0]}x{self.block[1]} blocks" if self.block else f"per {self.weight_strategy}"
        return f"FP8 e4m3 weights {source}, scaled {weights}; activations: {self.activations}"


def _field(config: dict[str, Any], key: str, allowed: tuple[Any, ...], what: str) -> Any:
    value = config.get(key)
    if value not in allowed:
        raise ValueError(f"{what}: {key}={value!r} is not supported (supported: {', '.join(map(repr, allowed))})")
    return value


def hf_fp8_scheme(config: dict[str, Any]) -> Fp8Scheme:
    """``quant_method: fp8``; ``{}`` (``--quantization fp8`` on an unquantized checkpoint)
    quantizes per output channel at load."""
    if not config:
        return Fp8Scheme("channel", "token", quantize_at_load=True)
    what = "quant_method fp8"
    _field(config, "activation_scheme", ("dynamic", None), what)
    block = config.get("weight_block_size")
    if block is None:
        raise ValueError(f"{what}: checkpoints without weight_block_size are not supported (hookllm reads the "
                         "block-wise weight_scale_inv layout)")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"{what}: weight_block_size={block!r} must be two positive ints")
    excluded = tuple(config.get("modules_to_not_convert") or ())
    return Fp8Scheme("block", "group", block=(int(block[0]), int(block[1])), scale_name="weight_scale_inv",
                     ignored=lambda name: any(key in name for key in excluded))


def compressed_tensors_scheme(config: dict[str, Any]) -> Fp8Scheme:
    """``quant_method: compressed-tensors`` with one FP8 config group targeting ``Linear``."""
    what = "compressed-tensors"
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{what}: format={fmt!r} is not served (the fp8 plugin reads float-quantized checkpoints)")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"{what}: {len(groups)} config groups; the fp8 plugin serves one group for every Linear")
    group = groups[0]
    if "Linear" not in (group.get("targets") or ()):
        raise ValueError(f"{what}: the config group targets {group.get('targets')!r}, not Linear layers")
    weights = group.get("weights") or {}
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        raise ValueError(f"{what}: weights of type {weights.get('type')!r} with {weights.get('num_bits')} bits; "
                         "the fp8 plugin serves 8-bit float ones")
    if weights.get("symmetric") is False or weights.get("dynamic"):
        raise ValueError(f"{what}: asymmetric or dynamic weight scales are not supported")
    strategy = _field(weights, "strategy", WEIGHT_STRATEGIES, f"{what} weights")
    block = None
    if strategy == "block":
        block = tuple(int(b) for b in weights.get("block_structure") or ())
        if len(block) != 2:
            raise ValueError(f"{what}: block strategy needs a block_structure of two ints")
    inputs = group.get("input_activations")
    if inputs is None:
        activations = "none"
    else:
        if (inputs.get("type"), inputs.get("num_bits")) != ("float", 8):
            raise ValueError(f"{what}: input activations of type {inputs.get('type')!r} with "
                             f"{inputs.get('num_bits')} bits are not served")
        if inputs.get("dynamic"):
            kind = _field(inputs, "strategy", ("token", "group"), f"{what} dynamic input_activations")
            activations = "group" if kind == "group" else "token"
            if kind == "group" and (block is None or inputs.get("group_size") != block[1]):
                raise ValueError(f"{what}: group-wise activations need block weights of the same group size")
        else:
            _field(inputs, "strategy", ("tensor",), f"{what} static input_activations")
            activations = "static"
    if strategy == "block" and activations == "token":
        activations = "group"  # one activation scale per block of columns, as the weight has
    kv = config.get("kv_cache_scheme")
    if kv is not None and ((kv.get("type"), kv.get("num_bits"), kv.get("strategy")) != ("float", 8, "tensor")):
        raise ValueError(f"{what}: kv_cache_scheme {kv!r}; the fp8 plugin reads per-tensor 8-bit float K/V scales")
    return Fp8Scheme(strategy, activations, block=block, kv_cache_scales=kv is not None,
                     ignored=_ignore_matcher(config.get("ignore") or ()))


def _ignore_matcher(patterns: tuple[str, ...] | list[str]) -> Callable[[str], bool]:
    """compressed-tensors' ``ignore``: module names, or ``re:`` regexes matched against them."""
    exact = {p for p in patterns if not p.startswith("re:")}
    regexes = [re.compile(p[3:]) for p in patterns if p.startswith("re:")]
    return lambda name: name in exact or any(r.match(name) for r in regexes)
