"""Named components a plugin provides to the core: what the ``register_components`` hook fills.

A component is found by its kind and name (``--tool-call-parser hermes``, a checkpoint's
``quant_method``), from whichever installed plugin registers it, so the plugin needs no
``--plugin``. :class:`Components` is one plugin's registrations; the plugin manager keeps one
per installed plugin (``PluginInfo.components``) and looks names up across them.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    import torch

    from hookllm.plugins.quantization import QuantizationMethod
    from hookllm.plugins.reasoning_parser import ReasoningParser
    from hookllm.plugins.tool_parser import ToolParser


class ComponentKind(enum.Enum):
    """A kind of named component; its value is how messages and ``hookllm plugins`` name one."""

    TOOL_PARSER = "tool parser"
    REASONING_PARSER = "reasoning parser"
    QUANTIZATION_METHOD = "quantization method"
    STRUCTURED_OUTPUT_BACKEND = "structured output backend"
    POOLER = "pooler"
    SPEC_PROPOSER = "speculative decoding method"

    @property
    def listing_key(self) -> str:
        """The key of this kind's names in ``hookllm plugins --json``: ``tool_parsers``."""
        return self.name.lower() + "s"


class Components:
    """One plugin's named components, by kind: ``register_components`` receives it empty and
    adds to it. A name is unique within its kind."""

    def __init__(self) -> None:
        self.by_kind: dict[ComponentKind, dict[str, Any]] = {kind: {} for kind in ComponentKind}

    def add(self, kind: ComponentKind, name: str, component: Any) -> None:
        """Register ``component`` as ``kind`` ``name``; ``ValueError`` if the plugin already did."""
        named = self.by_kind[kind]
        if name in named:
            raise ValueError(f"{kind.value} {name!r} is registered twice")
        named[name] = component

    def add_tool_parser(self, name: str, parser: type[ToolParser]) -> None:
        """``--tool-call-parser NAME``: a :class:`hookllm.plugins.tool_parser.ToolParser` subclass."""
        self.add(ComponentKind.TOOL_PARSER, name, parser)

    def add_reasoning_parser(self, name: str, parser: type[ReasoningParser]) -> None:
        """``--reasoning-parser NAME``: a :class:`hookllm.plugins.reasoning_parser.ReasoningParser` subclass."""
        self.add(ComponentKind.REASONING_PARSER, name, parser)

    def add_quantization_method(self, name: str, method: type[QuantizationMethod]) -> None:
        """A checkpoint's ``quant_method`` NAME, or ``--quantization NAME``: a
        :class:`hookllm.plugins.quantization.QuantizationMethod` subclass."""
        self.add(ComponentKind.QUANTIZATION_METHOD, name, method)

    def add_structured_output_backend(self, name: str, kinds: Iterable[str]) -> None:
        """A structured output backend enforcing ``kinds`` (``json``, ``regex``, ``choice``,
        ``grammar``, ``json_object``); the plugin enforces them with its other hooks."""
        self.add(ComponentKind.STRUCTURED_OUTPUT_BACKEND, name, tuple(kinds))

    def add_pooler(self, name: str, pooler: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        """``--pooler NAME``: the pooling runner's embedding of a prompt, ``pooler(hidden_states,
        request)`` with every prompt token's last hidden state (``[tokens, hidden]`` float32 on the
        device) and the request's ``CachedRequestState``, returning a 1-D tensor on the device."""
        self.add(ComponentKind.POOLER, name, pooler)

    def names(self, kind: ComponentKind) -> list[str]:
        return sorted(self.by_kind[kind])
