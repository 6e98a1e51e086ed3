"""hookllm's kernels in place of transformers' modules that compute the same thing, and the
transformers code a step can skip because it changes nothing.

transformers' RMSNorm is five to seven torch kernels (the fp32 cast, the square, the mean, the
rsqrt, two multiplies); hookllm's ``RMSNorm`` is one. A gated MLP runs its gate and up
projections as two matmuls over the same input; stacked, they are one. A module is swapped only
when, with its loaded weights, the replacement gives what the module gives on a random input
(same dtype, values within the dtype's rounding): a model whose norm differs (Gemma's
``1 + weight``, a norm kept in fp32) or whose MLP is wired otherwise keeps its own.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hookllm.layers import RMSNorm


def use_hookllm_modules(model: nn.Module) -> int:
    """Swap each RMSNorm module of ``model`` that hookllm's ``RMSNorm`` matches, and each gated
    MLP for one with its gate and up projections in one matmul; how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            replacement = _matching_norm(module) or _fused_gated_mlp(module)
            if replacement is not None:
                parent._modules[name] = replacement
                swapped += 1
    return swapped


class FusedGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``gate`` and ``up`` stacked in one weight: one matmul
    reads ``x`` once (transformers' code runs two)."""

    def __init__(self, gate_up: nn.Linear, act_fn: nn.Module, down_proj: nn.Linear):
        super().__init__()
        self.gate_up, self.act_fn, self.down_proj = gate_up, act_fn, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fused_gated_mlp(module: nn.Module) -> FusedGatedMLP | None:
    """The fused form of a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``) when
    it computes what the module does; the projections must be plain ``nn.Linear`` (a sharded one
    under tensor parallelism stays as it is)."""
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    down, act_fn = getattr(module, "down_proj", None), getattr(module, "act_fn", None)
    if (not all(type(m) is nn.Linear for m in (gate, up, down)) or not isinstance(act_fn, nn.Module)
            or gate.weight.shape != up.weight.shape or (gate.bias is None) != (up.bias is None)):
        return None
    gate_up = nn.Linear(gate.in_features, 2 * gate.out_features, bias=gate.bias is not None,
                        device=gate.weight.device, dtype=gate.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        gate_up.weight.copy_(torch.cat([gate.weight, up.weight]))
        if gate.bias is not None:
            gate_up.bias.copy_(torch.cat([gate.bias, up.bias]))
    fused = FusedGatedMLP(gate_up, act_fn, down)
    return fused if _computes_alike(module, fused, gate.in_features, gate.weight) else None


def _matching_norm(module: nn.Module) -> RMSNorm | None:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter) or weight.dim() != 1
            or not isinstance(eps, float) or set(module._parameters) != {"weight"} or module._buffers):
        return None
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = weight
    return norm if _computes_alike(module, norm, weight.shape[0], weight) else None


@torch.inference_mode()
def _computes_alike(module: nn.Module, replacement: nn.Module, features: int, like: torch.Tensor) -> bool:
    """Whether ``replacement`` gives what ``module`` gives on a random ``[4, features]`` input in
    ``like``'s dtype and device, within the dtype's rounding."""
    generator = torch.Generator(like.device).manual_seed(0)
    x = torch.randn(4, features, generator=generator, device=like.device).to(like.dtype)
    try:
        torch.testing.assert_close(replacement(x), module(x))
    except AssertionError:
        return False
    return True


@torch.inference_mode()
def head_alone(head: nn.Module | None, causal_lm_logits: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module | None:
    """``head`` when the CausalLM's logits are exactly ``head(hidden_states)``, else None.

    Checked on hidden states large enough that any scaling or soft-capping after the head shows
    in every dtype (a soft-cap of 30 leaves logits near 0 unchanged in bfloat16)."""
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or weight is None:
        return None
    generator = torch.Generator(weight.device).manual_seed(0)
    hidden = 100 * torch.randn(4, weight.shape[1], generator=generator, device=weight.device)
    hidden = hidden.to(weight.dtype)
    return head if torch.equal(causal_lm_logits(hidden), head(hidden)) else None
