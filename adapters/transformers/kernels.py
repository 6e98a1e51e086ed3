"""hookllm's kernels in place of transformers' modules that compute the same thing, and the
transformers code a step can skip because it changes nothing.

transformers' RMSNorm is five to seven torch kernels (the fp32 cast, the square, the mean, the
rsqrt, two multiplies); hookllm's ``RMSNorm`` is one. A module is swapped only when, with its
loaded weights, hookllm's norm gives what the module gives on a random input (same dtype,
values within the dtype's rounding): a model whose norm differs (Gemma's ``1 + weight``, a
norm kept in fp32) keeps its own.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hookllm.layers import RMSNorm


def use_hookllm_norms(model: nn.Module) -> int:
    """Swap each RMSNorm module of ``model`` that hookllm's ``RMSNorm`` matches; how many were."""
    swapped = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            replacement = _matching_norm(module)
            if replacement is not None:
                parent._modules[name] = replacement
                swapped += 1
    return swapped


@torch.inference_mode()
def _matching_norm(module: nn.Module) -> RMSNorm | None:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if (not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter) or weight.dim() != 1
            or not isinstance(eps, float) or set(module._parameters) != {"weight"} or module._buffers):
        return None
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = weight
    generator = torch.Generator(weight.device).manual_seed(0)
    x = torch.randn(4, weight.shape[0], generator=generator, device=weight.device).to(weight.dtype)
    expected = module(x)
    try:
        torch.testing.assert_close(norm(x), expected)
    except AssertionError:
        return None
    return norm


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
