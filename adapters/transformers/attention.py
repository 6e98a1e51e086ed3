"""hookllm's paged attention as a transformers attention implementation (``"hookllm"``).

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with the layer's projected, rotated query/key/value; registered under ``"hookllm"``, that
function stores K/V in the layer's paged cache and attends over it, so everything around
attention (RoPE variants, q/k norms, MLPs, MoE blocks) runs as transformers wrote it.

Only the attention function is registered, not a mask function: transformers then builds no
attention mask at all for this implementation (``masking_utils`` exits early for names its mask
interface lacks, in 5.17 as in 5.24), which also keeps its packed-sequence detection, a host
sync, out of the forward. Causality, the sliding window and sequence boundaries come from the
paged-attention metadata instead.

What each layer needs (head counts, head size, scale, window, soft-cap, sinks) is what
transformers' code passes: :func:`probe` runs a two-token forward once at load and records
every call, so nothing is guessed from config fields a model may not use; each later eager call
is checked against that record.

The paged layer runs behind one opaque operator (:func:`attention_op`), so that torch.compile
can trace a whole decoder forward and fuse transformers' code between the matmuls (RoPE, the
activations, residual adds) while the cache writes and kernels run unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from transformers import AttentionInterface

from hookllm.adapters.transformers.support import Unsupported
from hookllm.layers.attention import Attention

IMPLEMENTATION = "hookllm"
# Keyword arguments of an attention call that the layer honours, and bookkeeping ones that do not
# change what attention computes; any other one that is set is refused (it would be ignored).
HONOURED = frozenset({"sliding_window", "softcap", "s_aux", "is_causal"})
BOOKKEEPING = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions", "past_key_values",
                         "cache"})

@dataclass(frozen=True)
class LayerSpec:
    """What one transformers attention module passes to its attention function."""

    path: str  # the module's name in the transformers model, for messages
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    softcap: float | None
    uses_sinks: bool  # gpt-oss: per-head sink logits passed as ``s_aux``
    causal: bool  # False: an encoder's bidirectional attention

    @classmethod
    def of_call(cls, path: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None, kwargs: dict[str, Any]) -> "LayerSpec":
        """The spec of one call; :class:`Unsupported` for what the paged kernels cannot honour."""
        if attention_mask is not None:
            raise Unsupported(f"{path} builds its own attention mask or bias, which the transformers backend "
                              "cannot honour")
        unknown = sorted(k for k, v in kwargs.items() if k not in HONOURED | BOOKKEEPING and v is not None
                         and v is not False)
        if unknown:
            raise Unsupported(f"{path} passes {', '.join(unknown)} to its attention function, which the "
                              "transformers backend cannot honour")
        head_dim = query.shape[-1]
        if key.shape[-1] != head_dim or value.shape[-1] != head_dim:
            dims = f"{query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]}"
            raise Unsupported(f"{path}: query/key/value head dims {dims} differ, which hookllm's attention kernels "
                              "do not support")
        scale = head_dim**-0.5 if scaling is None else float(scaling)
        causal = getattr(module, "is_causal", True) is not False and kwargs.get("is_causal", True) is not False
        return cls(path, query.shape[1], key.shape[1], head_dim, scale, kwargs.get("sliding_window"),
                   kwargs.get("softcap"), kwargs.get("s_aux") is not None, causal)


class PagedLayer(Attention):
    """The paged ``Attention`` of one transformers attention module."""

    def __init__(self, spec: LayerSpec):
        super().__init__(spec.num_heads, spec.head_dim, spec.scale, spec.num_kv_heads,
                         sliding_window=spec.sliding_window, softcap=spec.softcap, causal=spec.causal)
        self.spec = spec

    def check(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None, kwargs: dict[str, Any]) -> None:
        """Refuse a call unlike the one probed at load (shapes and Python scalars only: no device
        work, so the check runs inside CUDA-graph capture too)."""
        spec = LayerSpec.of_call(self.spec.path, module, query, key, value, attention_mask, scaling, kwargs)
        if spec != self.spec or query.shape[0] != 1:
            raise ValueError(f"{spec.path}: transformers called attention with {spec} (batch {query.shape[0]}), "
                             f"unlike at load ({self.spec})")


class Route:
    """Where the attention calls of a forward pass go: :meth:`check` sees each call as
    transformers made it (eager forwards only), :meth:`attend` computes it."""

    def check(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None, kwargs: dict[str, Any]) -> None:
        raise NotImplementedError

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class PagedRoute(Route):
    """A real forward: each module's call goes to ``layers[module.layer_idx - first_layer]``
    (``first_layer``: the first of a pipeline stage's layers)."""

    def __init__(self, layers: nn.ModuleList, first_layer: int = 0):
        self.layers = layers
        self.first_layer = first_layer

    def check(self, module, query, key, value, attention_mask, scaling, kwargs):
        self.layers[module.layer_idx - self.first_layer].check(module, query, key, value, attention_mask, scaling,
                                                               kwargs)

    def attend(self, layer_index, q, k, v, sinks):
        return self.layers[layer_index - self.first_layer](q, k, v, sinks=sinks)


# Per thread (a context variable): engines stepping in different threads keep their own routes.
_route: contextvars.ContextVar[Route | None] = contextvars.ContextVar("hookllm_attention", default=None)


@contextlib.contextmanager
def routed_to(route: Route) -> Iterator[None]:
    """Send the attention calls of the forward passes inside to ``route``."""
    token = _route.set(route)
    try:
        yield
    finally:
        _route.reset(token)


def _current_route() -> Route:
    route = _route.get()
    if route is None:
        raise RuntimeError("hookllm attention ran outside TransformersForCausalLM.forward")
    return route


@torch.library.custom_op("hookllm::transformers_attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                 layer_index: int) -> torch.Tensor:
    """``[T, heads * head_dim]`` q/k/v of layer ``layer_index`` -> its attention output, through
    the current route. An opaque operator, so that torch.compile traces transformers' code
    around attention (and fuses it) while the paged cache writes and the Triton kernels, which
    read the step's metadata on the host, run as they are."""
    return _current_route().attend(layer_index, q.contiguous(), k.contiguous(), v.contiguous(), sinks)


@attention_op.register_fake
def _attention_op_shape(q, k, v, sinks, layer_index):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls: ``[1, heads, T, head_dim]`` query/key/value ->
    ``[1, T, heads, head_dim]``. ``attention_mask`` is None unless a model builds its own (no
    mask function is registered: refused), ``dropout`` 0 (eval). An eager forward checks each
    call against what the layer did at load; a compiled one was checked when it was traced."""
    if not torch.compiler.is_compiling():
        _current_route().check(module, query, key, value, attention_mask, scaling, kwargs)
    num_tokens, head_dim = query.shape[2], query.shape[3]
    q, k, v = (t[0].transpose(0, 1).reshape(num_tokens, -1) for t in (query, key, value))
    out = attention_op(q, k, v, kwargs.get("s_aux"), getattr(module, "layer_idx", -1))
    return out.view(1, num_tokens, -1, head_dim), None


def register() -> None:
    """Make ``attn_implementation="hookllm"`` available to transformers models (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, paged_attention)


class _Recorder(Route):
    """The route of :func:`probe`: records what each attention module passes."""

    def __init__(self, model: nn.Module):
        self.calls: dict[nn.Module, LayerSpec] = {}
        self.paths = {module: path for path, module in model.named_modules()}

    def check(self, module, query, key, value, attention_mask, scaling, kwargs):
        path = self.paths.get(module, type(module).__name__)
        if module in self.calls:
            raise Unsupported(f"{path} runs twice per forward (shared across layers), so it cannot own one KV cache")
        self.calls[module] = LayerSpec.of_call(path, module, query, key, value, attention_mask, scaling, kwargs)

    def attend(self, layer_index, q, k, v, sinks):
        return torch.zeros_like(q)


@torch.inference_mode()
def probe(model: nn.Module, forward: Callable[[torch.Tensor, torch.Tensor], object],
          first_layer: int = 0, causal: bool = True) -> list[LayerSpec]:
    """Run ``forward(input_ids, positions)``, the decoder's (or a pipeline stage's), on two tokens
    (current default device; weights may be uninitialized) and return, in ``layer_idx`` order,
    what each attention module passed to the attention function; :class:`Unsupported` if the
    calls do not make a model hookllm can page, one layer each from ``first_layer``, all causal
    (a decoder) or all bidirectional (``causal=False``: an encoder)."""
    recorder = _Recorder(model)
    with routed_to(recorder):
        forward(torch.zeros(2, dtype=torch.long), torch.arange(2))
    calls = recorder.calls
    name = type(model).__name__
    if not calls:
        raise Unsupported(f"{name} has no attention layer that calls transformers' attention interface")
    indices = [getattr(module, "layer_idx", None) for module in calls]
    if sorted(i for i in indices if isinstance(i, int)) != list(range(first_layer, first_layer + len(calls))):
        raise Unsupported(f"{name}: its attention modules' layer_idx are {indices}, not one per layer from "
                          f"{first_layer}")
    wrong = next((spec for spec in calls.values() if spec.causal != causal), None)
    if wrong is not None and causal:
        raise Unsupported(f"{wrong.path} has bidirectional attention: an encoder, which the transformers backend "
                          "serves with the pooling runner only")
    if wrong is not None:
        raise Unsupported(f"{wrong.path} has causal attention in an encoder")
    return [spec for _, spec in sorted(zip(indices, calls.values()), key=lambda pair: pair[0])]
