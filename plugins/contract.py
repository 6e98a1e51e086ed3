"""What an adapter's model class must offer the core: :class:`ModelProtocol`.

The worker builds the class from the checkpoint's HF config, feeds ``load_weights`` the
checkpoint's tensors, runs ``forward`` on each step's flat batch and ``compute_logits`` on the
rows that sample; multimodal adapters splice their rows into ``embed_tokens``' output. Check a
class with :func:`contract_violations`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class ModelProtocol(Protocol):
    """A ``torch.nn.Module`` over a flat batch: no batch dimension, no attention mask (the
    attention layers read the paged-cache metadata from the forward context)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``[num_tokens]`` ids and positions (or ``[num_tokens, hidden]`` embeddings instead of
        the ids) -> ``[num_tokens, hidden]`` hidden states."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` -> ``[num_tokens, hidden]``: the token embedding."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden]`` -> ``[rows, vocab]``."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy ``(checkpoint name, tensor)`` pairs into the parameters; a missing or unexpected
        tensor is an error."""


def contract_violations(model_cls: type) -> list[str]:
    """How ``model_cls`` departs from :class:`ModelProtocol`: each member it lacks, or whose
    parameters (names, in order, and which have defaults) differ. Empty when it conforms."""
    problems = []
    for name in ("forward", "embed_tokens", "compute_logits", "load_weights"):
        member = getattr(model_cls, name, None)
        if not callable(member):
            problems.append(f"{model_cls.__name__} has no method {name}")
            continue
        want = _parameters(getattr(ModelProtocol, name))
        got = _parameters(member)
        if got != want:
            problems.append(f"{model_cls.__name__}.{name}{_show(got)} should take {_show(want)}")
    return problems


def _parameters(function: Any) -> list[tuple[str, bool]]:
    """(name, has a default) of each parameter after ``self``."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.default is not inspect.Parameter.empty) for p in params]


def _show(params: list[tuple[str, bool]]) -> str:
    return "(" + ", ".join(name + ("=..." if default else "") for name, default in params) + ")"
