"""Reasoning parsers: a reasoning model's thinking split from its answer, for ``hookllm serve --reasoning-parser``.

The bundled parsers, registered through ``register_components`` (a hook called on every
installed plugin, so they need no ``--plugin``):

- ``qwen3``: Qwen3 begins a reply with ``<think>...</think>`` when it thinks; a reply without
  ``<think>`` (``enable_thinking=False``) is all content;
- ``deepseek_r1``: DeepSeek-R1 (and models whose template opens ``<think>`` in the prompt, as
  QwQ's and Qwen3-Thinking-2507's): the reply begins inside the reasoning, which ``</think>``
  ends; a reply without ``</think>`` is all reasoning.

Both subclass the parser API's :class:`~hookllm.plugins.reasoning_parser.ThinkReasoningParser`.
"""

from __future__ import annotations

from hookllm.plugins.components import Components
from hookllm.plugins.hookspecs import hookimpl
from hookllm.plugins.reasoning_parser import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    opened = False


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    opened = True


@hookimpl
def register_components(components: Components) -> None:
    components.add_reasoning_parser("qwen3", Qwen3ReasoningParser)
    components.add_reasoning_parser("deepseek_r1", DeepSeekR1ReasoningParser)
