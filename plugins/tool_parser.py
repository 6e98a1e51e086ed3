"""What a tool parser is: one reply's text in, its content and tool calls out, whole or streamed.

A parser reads one choice's reply (the content, after any reasoning section) as it is
generated: ``feed`` takes each new piece of text and returns what can be told already,
``finish`` what is left once the reply has ended. ``parse`` is the two at once, so a whole
reply and the same reply streamed in any pieces come out the same. A parser holds back text
that may still become the start of a tool call, and every piece of text it reads ends up
either in the content or in a call: text it cannot make a call of (malformed JSON, a call
cut short) is content.

Two building blocks cover the usual formats: :class:`TaggedToolParser` (calls between a start
and an end marker, anywhere in the reply, as Hermes' ``<tool_call>...</tool_call>``) and
:class:`JsonCallsParser` (a reply made of JSON call objects, as Llama 3's).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCallDelta:
    """A piece of one tool call. ``index`` numbers a reply's calls from 0, in order; ``name`` is
    set on a call's first piece only; ``arguments`` is a piece of its arguments' JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What a parser tells of the text it was fed: new content, and new pieces of tool calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def merged(self, later: ParsedDelta) -> ParsedDelta:
        """This delta followed by ``later``, a call's consecutive pieces joined into one."""
        calls = list(self.calls)
        for piece in later.calls:
            if calls and calls[-1].index == piece.index:
                calls[-1] = ToolCallDelta(piece.index, calls[-1].name, calls[-1].arguments + piece.arguments)
            else:
                calls.append(piece)
        return ParsedDelta(self.content + later.content, calls)


@dataclass
class ParsedToolCall:
    """One whole tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class ParsedReply:
    """A whole reply parsed: its content (None when there is none) and its tool calls."""

    content: str | None
    calls: list[ParsedToolCall]

    @classmethod
    def of(cls, delta: ParsedDelta) -> ParsedReply:
        calls: list[ParsedToolCall] = []
        for piece in delta.calls:
            if piece.name is not None:
                calls.append(ParsedToolCall(piece.name, piece.arguments))
            else:
                calls[piece.index].arguments += piece.arguments
        return cls(delta.content or None, calls)


class ToolParser(ABC):
    """Reads one reply (a new parser per reply). ``tools`` are the request's tool definitions,
    OpenAI's ``{"type": "function", "function": {"name", "description", "parameters"}}``, for a
    parser whose format needs them (say, to type the arguments it reads)."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """The next piece of the reply: what can be told of it now (text that may still turn
        into a call is held back)."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The reply has ended: everything held back, as content or calls."""

    def parse(self, text: str) -> ParsedReply:
        """A whole reply."""
        return ParsedReply.of(self.feed(text).merged(self.finish()))


def json_call(text: str) -> ParsedToolCall | None:
    """A JSON ``{"name": ..., "arguments": {...}}`` object (or ``"parameters"``; none is ``{}``)
    as a call; None when ``text`` is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``marker`` (shorter
    than it): text the next piece may complete into the marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class TaggedToolParser(ToolParser):
    """Calls written between ``start`` and ``end`` markers, anywhere in the reply, several per
    reply. Subclasses set the markers and :meth:`parse_call`.

    The text around the calls is the content, less the whitespace before each call and after
    the last one. A call whose text :meth:`parse_call` refuses stays in the content, markers and
    all; so does an unclosed one at the end of the reply, unless :meth:`parse_call` takes it as
    it is (a model may stop instead of writing the end marker)."""

    start: str
    end: str

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._held = ""  # undecided text: a possible start of a call, or the call so far
        self._inside = False
        self._gap = ""  # the whitespace before the current call: content again if it is no call
        self._after_call = False  # since the last call, only whitespace (dropped at the end)
        self._calls = 0

    @abstractmethod
    def parse_call(self, body: str) -> ParsedToolCall | None:
        """The call written between the markers (``body``), or None if it is not one."""

    def feed(self, text: str) -> ParsedDelta:
        held, out = self._held + text, ParsedDelta()
        while True:
            if self._inside:
                end = held.find(self.end)
                if end < 0:
                    break
                out = out.merged(self._close(held[:end], self.end))
                held = held[end + len(self.end):]
                continue
            start = held.find(self.start)
            if start < 0:
                keep = partial_marker(held, self.start)
                before = held[:len(held) - keep]
                keep += len(before) - len(before.rstrip())  # whitespace before a possible call
                if keep < len(held):
                    out.content += held[:len(held) - keep]
                    held, self._after_call = held[len(held) - keep:], False
                break
            before = held[:start]
            out.content += before.rstrip()
            self._gap = before[len(before.rstrip()):]
            held, self._inside = held[start + len(self.start):], True
        self._held = held
        return out

    def finish(self) -> ParsedDelta:
        held, self._held = self._held, ""
        if self._inside:
            return self._close(held, "")
        return ParsedDelta(content="" if self._after_call and not held.strip() else held)

    def _close(self, body: str, end: str) -> ParsedDelta:
        """The call ``body`` ended (by ``end``, or by the reply's end): a call, or content."""
        call = self.parse_call(body)
        gap, self._gap, self._inside = self._gap, "", False
        self._after_call = call is not None
        if call is None:
            return ParsedDelta(content=gap + self.start + body + end)
        self._calls += 1
        return ParsedDelta(calls=[ToolCallDelta(self._calls - 1, call.name, call.arguments)])


class JsonCallsParser(ToolParser):
    """A reply made of JSON call objects (``{"name": ..., "arguments" or "parameters": ...}``):
    optionally ``opening`` first, objects separated by ``separator``, optionally ``closing``
    last (those two are one character each). A reply that does not begin so is content, whole; past the last call, text that does
    not fit the format is content, from the end of that call on."""

    opening: str = ""
    separator: str = ";"
    closing: str = ""

    # States, by what comes next.
    _START, _OBJECT, _NEXT, _AFTER, _DONE, _CONTENT = range(6)

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._state = self._START
        self._raw: list[str] = []  # the text since the last call (content if no call follows)
        self._head = ""  # START: the opening read so far
        self._object_start = 0  # OBJECT: where the object begins in _raw
        self._depth, self._in_string, self._escaped = 0, False, False
        self._calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        for position, char in enumerate(text):
            if self._state == self._CONTENT:
                out.content += text[position:]
                break
            self._raw.append(char)
            call = self._step(char)
            if call is not None:
                out = out.merged(ParsedDelta(calls=[ToolCallDelta(self._calls, call.name, call.arguments)]))
                self._calls += 1
                self._raw = []
            elif self._state == self._CONTENT:
                out.content += "".join(self._raw)
                self._raw = []
        return out

    def finish(self) -> ParsedDelta:
        raw, self._raw = "".join(self._raw), []
        # What follows the last call is only whitespace and separators, unless a call was cut short.
        if self._calls and self._state in (self._NEXT, self._AFTER, self._DONE):
            return ParsedDelta()
        return ParsedDelta(content=raw)

    def _step(self, char: str) -> ParsedToolCall | None:
        """Read one character (already in ``_raw``); a call when it ends one."""
        state = self._state
        if state == self._OBJECT:
            return self._scan(char)
        if char.isspace() and not (state == self._START and self._head):
            return None
        if state == self._START:
            self._head += char
            if self._head == "{":
                self._open_object()
            elif self.opening and self._head == self.opening:
                self._state = self._NEXT
            elif not self.opening.startswith(self._head):
                self._state = self._CONTENT
        elif state == self._NEXT and char == "{":
            self._open_object()
        elif state == self._AFTER and char == self.separator:
            self._state = self._NEXT
        elif state == self._AFTER and self.closing and char == self.closing:
            self._state = self._DONE
        else:  # not the format (after DONE, nothing but whitespace may follow)
            self._state = self._CONTENT
        return None

    def _open_object(self) -> None:
        self._state, self._object_start = self._OBJECT, len(self._raw) - 1
        self._depth, self._in_string, self._escaped = 1, False, False

    def _scan(self, char: str) -> ParsedToolCall | None:
        """One character of a JSON object; at its end, the call (or content if it is none)."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return None
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 0:
                call = json_call("".join(self._raw[self._object_start:]))
                self._state = self._AFTER if call is not None else self._CONTENT
                return call
        return None
