"""The quantization contract: how a plugin serves quantized weights.

A plugin names the methods it serves through the ``register_components`` hook
(``components.add_quantization_method(name, QuantizationMethod subclass)``, installed-wide, as
the parsers are). The engine picks
one by the checkpoint's ``quantization_config.quant_method``, or by ``--quantization NAME``
(which must then agree with the checkpoint's, if it has one), and builds it from that config
(``{}`` for an unquantized checkpoint). Every step of loading then asks it:

1. ``linear_method(prefix, layer)`` for each of the model's parallel linear layers
   (:mod:`hookllm.layers.linear`), by module path, and ``moe_method(prefix, layer)`` for each
   :class:`hookllm.layers.FusedMoE`. A returned :class:`LinearMethod` / :class:`MoeMethod`
   replaces the layer's parameters (``create_weights``, right after the model is built, on its
   device); each new parameter carries a :class:`hookllm.layers.linear.ParamLayout` so the
   layer's own loader shards it across tensor-parallel ranks with the weight.
2. ``checkpoint_tensors(weights, model)`` sees the checkpoint's tensors on their way to the
   model's loader: to take those that are not parameters (KV-cache scales, say).
3. After the weights are loaded, each layer's method's ``process_weights_after_loading`` (the
   place to quantize weights loaded in the model dtype, or to repack); then the layer's matmul
   is its method's ``apply``.

``describe()`` is the ``quantization`` line of the engine's start-up summary, so the numeric path
chosen is never silent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from hookllm.config import ModelConfig
    from hookllm.layers.fused_moe import FusedMoE
    from hookllm.layers.linear import LoadedWeight, _ShardedLinear

logger = logging.getLogger(__name__)


class LinearMethod:
    """One linear layer's quantized weights: how they are made, loaded and multiplied."""

    def create_weights(self, layer: _ShardedLinear) -> None:
        """Replace ``layer.weight`` (and add scales) with the parameters the checkpoint holds,
        local (this rank's) shapes, each with a ``param_layout`` unless it is laid out as the
        weight."""

    def process_weights_after_loading(self, layer: _ShardedLinear) -> None:
        """Called once every tensor is loaded."""

    def apply(self, layer: _ShardedLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + bias`` for this rank's shard: ``[tokens, in] -> [tokens, out]``."""
        raise NotImplementedError


class MoeMethod:
    """One :class:`hookllm.layers.FusedMoE`'s quantized experts."""

    def create_weights(self, layer: FusedMoE) -> None:
        """Replace ``gate_up_proj`` / ``down_proj`` (and set the scale parameters) with the
        checkpoint's, local shapes; a scale's ``param_layout`` says how the checkpoint holds it
        (per tensor, row, or block: see ``FusedMoE._load_expert_scale``)."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Called once every tensor is loaded. The fused MoE kernels then read the layer's
        ``gate_up_proj`` / ``down_proj`` in the model dtype, or as e4m3 with float32 scales
        ``gate_up_proj_scale`` / ``down_proj_scale`` ``[experts, rows, column groups]``."""


class QuantizationMethod:
    """A quantization method, built once per model from the checkpoint's ``quantization_config``.

    ``__init__`` raises ``ValueError`` naming what it cannot serve (a scheme, a bit width)."""

    name: ClassVar[str] = ""

    def __init__(self, quantization_config: dict[str, Any], model_config: ModelConfig):
        self.quantization_config = quantization_config
        self.model_config = model_config

    def linear_method(self, prefix: str, layer: _ShardedLinear) -> LinearMethod | None:
        """The method of the linear layer at module path ``prefix``; None leaves it unquantized."""
        return None

    def moe_method(self, prefix: str, layer: FusedMoE) -> MoeMethod | None:
        """The method of the experts at ``prefix``; None leaves them in the model dtype."""
        return None

    def checkpoint_tensors(self, weights: Iterable[tuple[str, LoadedWeight]],
                           model: nn.Module) -> Iterator[tuple[str, LoadedWeight]]:
        """The checkpoint's tensors, as the model's loader should see them."""
        yield from weights

    def describe(self) -> str:
        """One line for the log: the formats and the kernels this model will run."""
        return self.name


def checkpoint_quant_method(hf_config: Any) -> tuple[str | None, dict[str, Any]]:
    """The checkpoint's ``quantization_config``: ``(quant_method, the config as a dict)``, or
    ``(None, {})`` for an unquantized checkpoint."""
    from hookllm.config import text_config_of

    quantization = (getattr(hf_config, "quantization_config", None)
                    or getattr(text_config_of(hf_config), "quantization_config", None))
    if not quantization:
        return None, {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else vars(quantization)
    return str(quantization.get("quant_method", "unknown")), dict(quantization)


def quantize_model(model: nn.Module, method: QuantizationMethod) -> None:
    """Give every parallel linear layer and MoE layer of ``model`` its method's parameters."""
    from hookllm.layers.fused_moe import FusedMoE
    from hookllm.layers.linear import _ShardedLinear

    for prefix, module in model.named_modules():
        if isinstance(module, _ShardedLinear):
            module.quant_method = method.linear_method(prefix, module)
            quantized = module.quant_method
        elif isinstance(module, FusedMoE):
            module.quant_method = method.moe_method(prefix, module)
            quantized = module.quant_method
        else:
            continue
        if quantized is not None:
            quantized.create_weights(module)
    model.quantization_method = method
    logger.debug("quantization: %s", method.describe())  # the engine's start-up summary shows it too


def finish_loading(model: nn.Module) -> None:
    """Run each quantized layer's ``process_weights_after_loading``."""
    for module in model.modules():
        quantized = getattr(module, "quant_method", None)
        if isinstance(quantized, (LinearMethod, MoeMethod)):
            quantized.process_weights_after_loading(module)


def quantized_by(model: nn.Module) -> QuantizationMethod | None:
    """The method :func:`quantize_model` applied to ``model``, if any."""
    return getattr(model, "quantization_method", None)


def resolve_quantization(model_config: ModelConfig, requested: str | None,
                         lookup: Callable[[str], type[QuantizationMethod]]) -> QuantizationMethod | None:
    """The method serving this checkpoint: its ``quant_method``, or ``requested``
    (``--quantization``), found with ``lookup`` (the plugin manager's, which names the
    installed methods when none serves it). ``ValueError`` for a request that contradicts
    the checkpoint, or naming what the method cannot serve."""
    found, config = checkpoint_quant_method(model_config.hf_config)
    if requested and found and requested != found:
        raise ValueError(f"--quantization {requested} does not match the checkpoint's quant_method {found!r}")
    name = requested or found
    if name is None:
        return None
    try:
        method_cls = lookup(name)
    except ValueError as exc:
        where = "--quantization" if requested else f"{model_config.path}: quantization_config.quant_method"
        raise ValueError(f"{where} {name!r}: {exc}") from None
    return method_cls(config, model_config)
