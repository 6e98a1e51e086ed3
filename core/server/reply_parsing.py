"""Chat replies as the API reports them: the reasoning split off first (``--reasoning-parser``),
then tool calls parsed out of the content (``--tool-call-parser``, or the parsers of
``tool_choice: "required"`` and a named function), one choice at a time, whole or as deltas.

The parsers are plugins' (registered through ``register_components``), found by name among the
installed plugins.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hookllm.plugins.components import ComponentKind
from hookllm.plugins.manager import PluginManager
from hookllm.plugins.reasoning_parser import ReasoningDelta, ReasoningParser
from hookllm.plugins.tool_parser import ParsedDelta, ToolParser
from hookllm.server.protocol import (ChatResponseMessage, DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                     FunctionCall, ToolCall, tool_call_id)


@functools.cache
def installed_plugins() -> PluginManager:
    """Every installed plugin, found once per process."""
    return PluginManager()


def tool_parser_class(name: str) -> type[ToolParser]:
    """The tool parser an installed plugin registers as ``name`` (``ValueError`` naming those there are)."""
    return installed_plugins().component(ComponentKind.TOOL_PARSER, name)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The reasoning parser an installed plugin registers as ``name`` (``ValueError`` naming those there are)."""
    return installed_plugins().component(ComponentKind.REASONING_PARSER, name)


@dataclass(frozen=True)
class ReasoningOptions:
    """What a chat request asks of its replies' reasoning (with a reasoning parser): ``separate``
    false leaves it in the content as the model wrote it (SGLang's ``separate_reasoning``),
    ``include`` false drops it (vLLM's ``include_reasoning``), ``stream`` false holds a stream's
    reasoning back and sends it in one delta once it has ended (SGLang's ``stream_reasoning``)."""

    separate: bool = True
    include: bool = True
    stream: bool = True


class ReplyParser:
    """One choice's reply: ``feed`` its text deltas (``final`` with the last), or ``parse`` it whole.

    ``reasoning`` splits off the reasoning; ``tools`` parses the content that follows; either
    may be None (the text passes as it is). Calls past ``max_calls`` are dropped
    (``parallel_tool_calls: false``). Each call gets its id here. ``options`` say what becomes
    of the reasoning."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None,
                 options: ReasoningOptions = ReasoningOptions()):
        self._reasoning = reasoning if options.separate else None
        self._tools, self._max_calls, self._options = tools, max_calls, options
        self._ids: list[str] = []  # by call index
        self._held = ""  # streamed reasoning not sent yet (options.stream false)

    def with_options(self, options: ReasoningOptions) -> ReplyParser:
        """This parser (not fed yet) with ``options``."""
        return ReplyParser(self._reasoning, self._tools, self._max_calls, options)

    @property
    def called(self) -> bool:
        """Whether the reply has made a tool call so far."""
        return bool(self._ids)

    def feed(self, text: str, final: bool = False) -> DeltaMessage:
        reasoning, content, calls = self._split(text, final)
        if not self._options.stream:  # sent once the reply has gone past it
            self._held += reasoning
            reasoning = ""
            if final or content or calls:
                reasoning, self._held = self._held, ""
        if not self._options.include:
            reasoning = ""
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None)

    def parse(self, text: str) -> ChatResponseMessage:
        reasoning, content, calls = self._split(text, final=True)
        if not self._options.include:
            reasoning = ""
        tool_calls = [ToolCall(id=call.id, function=FunctionCall(name=call.function.name,
                                                                 arguments=call.function.arguments))
                      for call in calls]
        # As OpenAI: no content (null) beside tool calls or reasoning, rather than "".
        return ChatResponseMessage(content=content if content or not (tool_calls or reasoning) else None,
                                   reasoning_content=reasoning or None, tool_calls=tool_calls or None)

    def _split(self, text: str, final: bool) -> tuple[str, str, list[DeltaToolCall]]:
        """``text``'s reasoning, content and tool call deltas (with ``final``, all that was held back too)."""
        split = ReasoningDelta(content=text)
        if self._reasoning is not None:
            split = self._reasoning.feed(text)
            if final:
                split = split.merged(self._reasoning.finish())
        if self._tools is None:
            return split.reasoning, split.content, []
        parsed = self._tools.feed(split.content)
        if final:
            parsed = parsed.merged(self._tools.finish())
        return split.reasoning, parsed.content, self._deltas(parsed)

    def _deltas(self, parsed: ParsedDelta) -> list[DeltaToolCall]:
        deltas = []
        for piece in parsed.calls:
            if self._max_calls is not None and piece.index >= self._max_calls:
                continue
            if piece.name is not None:
                self._ids.append(tool_call_id())
                deltas.append(DeltaToolCall(index=piece.index, id=self._ids[-1], type="function",
                                            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments)))
            elif piece.arguments:
                deltas.append(DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments)))
        return deltas
