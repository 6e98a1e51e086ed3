"""hookllm's kernels in place of transformers' modules that compute the same thing, and the
transformers code a step can skip because it changes nothing.

transformers' RMSNorm is five to seven torch kernels (the fp32 cast, the square, the mean, the
rsqrt, two multiplies); hookllm's ``RMSNorm`` is one. A gated MLP runs its gate and up
projections as two matmuls over the same input, and an attention module its q, k and v
projections as three; stacked, each is one. A module is swapped only when, with its loaded
weights, the replacement gives what the module gives on a random input (same dtype, values
within the dtype's rounding; for attention, the same query, key and value reaching the attention
function with the same settings, and the same output): a model whose norm differs (Gemma's
``1 + weight``, a norm kept in fp32) or whose MLP or attention is wired otherwise keeps its own.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch
from torch import nn

from hookllm.adapters.transformers import attention
from hookllm.layers import RMSNorm


def use_hookllm_modules(model: nn.Module) -> int:
    """Swap each RMSNorm module of ``model`` that hookllm's ``RMSNorm`` matches, each gated MLP
    for one with its gate and up projections in one matmul, and each attention module for one
    with its q, k and v projections in one matmul; how many were swapped."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    swapped = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            replacement = _matching_norm(module) or _fused_gated_mlp(module) or _fused_qkv_attention(module, rotary)
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


class FusedQKVAttention(nn.Module):
    """A transformers self-attention module (``attention``: its ``o_proj``, q/k norms, settings
    and ``layer_idx`` kept) whose q, k and v projections run as one matmul, ``qkv_proj``; then,
    as transformers' code does: per-head views, the q/k norms if any, the module file's
    ``apply_rotary_pos_emb``, the attention function (with the module's window and soft-cap,
    ``settings``), ``o_proj``."""

    def __init__(self, attention_module: nn.Module, qkv_proj: nn.Linear, sizes: list[int],
                 apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.attention, self.qkv_proj, self.sizes, self.apply_rotary = attention_module, qkv_proj, sizes, apply_rotary
        self.settings: dict[str, Any] = {}

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, *cache: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention forward; its KV cache argument (positional or named) is unused:
        hookllm runs transformers' models with ``use_cache=False``."""
        module = self.attention
        for name in ("past_key_values", "cache"):
            kwargs.pop(name, None)
        shape = (*hidden_states.shape[:-1], -1, module.head_dim)
        query, key, value = (t.view(shape) for t in self.qkv_proj(hidden_states).split(self.sizes, dim=-1))
        if getattr(module, "q_norm", None) is not None:
            query, key = module.q_norm(query), module.k_norm(key)
        cos, sin = position_embeddings
        query, key = self.apply_rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        out, weights = attention.paged_attention(module, query, key, value.transpose(1, 2), attention_mask,
                                                 scaling=module.scaling, **self.settings, **kwargs)
        return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def _fused_qkv_attention(module: nn.Module, rotary: nn.Module | None) -> FusedQKVAttention | None:
    """The fused form of an attention module (``q_proj``, ``k_proj``, ``v_proj`` over one input,
    ``o_proj``, ``head_dim``, ``scaling``, its file's ``apply_rotary_pos_emb``) when, on a random
    4-token input, it passes the attention function the query, key, value and settings the module
    passes and gives what the module gives; the projections must be plain ``nn.Linear``. The
    module's own q, k and v projections are dropped once fused."""
    projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    apply_rotary = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    if (not all(type(m) is nn.Linear for m in projections) or rotary is None or apply_rotary is None
            or not isinstance(getattr(module, "head_dim", None), int) or not hasattr(module, "scaling")
            or len({(m.in_features, m.bias is None) for m in projections[:3]}) != 1):
        return None
    q, k, v = projections[:3]
    sizes = [q.out_features, k.out_features, v.out_features]
    qkv = nn.Linear(q.in_features, sum(sizes), bias=q.bias is not None, device=q.weight.device,
                    dtype=q.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        if q.bias is not None:
            qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
    fused = FusedQKVAttention(module, qkv, sizes, apply_rotary)
    generator = torch.Generator(q.weight.device).manual_seed(0)
    x = torch.randn(1, 4, q.in_features, generator=generator, device=q.weight.device).to(q.weight.dtype)
    try:
        position_embeddings = _rotary_tables(rotary, module, x)
        theirs = _attention_call(module, x, position_embeddings)
        # What the module passes from its own attributes or config (constant once loaded).
        fused.settings = {name: value for name, value in (("sliding_window", theirs[-1].sliding_window),
                                                          ("softcap", theirs[-1].softcap)) if value is not None}
        mine = _attention_call(fused, x, position_embeddings)
    except (TypeError, ValueError, RuntimeError, AttributeError, LookupError):  # wired otherwise: kept
        return None
    try:
        for ours, reference in zip(mine[:-1], theirs[:-1]):
            torch.testing.assert_close(ours, reference)
    except AssertionError:
        return None
    if mine[-1] != theirs[-1]:
        return None
    del module.q_proj, module.k_proj, module.v_proj
    return fused


def _rotary_tables(rotary: nn.Module, module: nn.Module, x: torch.Tensor) -> Any:
    """The model's RoPE cos and sin for ``x``'s positions; a RoPE that differs by layer type
    (Gemma 3's) is asked for the module's own (either would give both forwards the same)."""
    positions = torch.arange(x.shape[1], device=x.device)[None]
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return rotary(x, positions, getattr(module, "layer_type", None))
    return rotary(x, positions)


class _Capture(attention.Route):
    """A route that records the one attention call of a module's forward and answers with its query."""

    def check(self, module, query, key, value, attention_mask, scaling, kwargs):
        self.spec = attention.LayerSpec.of_call("", module, query, key, value, attention_mask, scaling, kwargs)

    def attend(self, layer_index, q, k, v, sinks):
        self.tensors = (q, k, v)
        return q.clone()


@torch.inference_mode()
def _attention_call(module: nn.Module, x: torch.Tensor, position_embeddings: Any) -> tuple[Any, ...]:
    """``module``'s output on ``x`` and what it passed the attention function: query, key and
    value (as the paged layer takes them) and its ``LayerSpec``."""
    capture = _Capture()
    with attention.routed_to(capture):
        out = module(hidden_states=x, position_embeddings=position_embeddings, attention_mask=None)[0]
    return (out, *capture.tensors, capture.spec)


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
