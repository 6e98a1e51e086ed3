"""What a reasoning parser is: one reply's text in, its reasoning and its content out, whole or streamed.

As a tool parser does (:mod:`hookllm.plugins.tool_parser`), a reasoning parser reads one
choice's reply as it is generated: ``feed`` each new piece, ``finish`` at its end, ``parse``
for a whole reply, with the same result however the reply was cut into pieces. Every piece of
text ends up in the reasoning or in the content, but for the markers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from hookllm.plugins.tool_parser import partial_marker


@dataclass
class ReasoningDelta:
    """What a reasoning parser tells of the text it was fed: new reasoning, new content."""

    reasoning: str = ""
    content: str = ""

    def merged(self, later: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + later.reasoning, self.content + later.content)


class ReasoningParser(ABC):
    """Reads one reply (a new parser per reply)."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """The next piece of the reply: what can be told of it now (a possible marker is held back)."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The reply has ended: everything held back."""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply: its reasoning and its content, each None when empty."""
        delta = self.feed(text).merged(self.finish())
        return delta.reasoning or None, delta.content or None


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between ``start`` and ``end`` markers at the beginning of the reply.

    A reply that begins with ``start`` (after whitespace) reasons until ``end``, or to its end
    when it has none (cut short). With ``opened`` (the chat template wrote ``start`` into the
    prompt) the reply begins inside the reasoning, with or without ``start``; without it, a
    reply that does not begin with ``start`` is all content. The whitespace after ``end`` is
    dropped."""

    start = "<think>"
    end = "</think>"
    opened = False

    _HEAD, _REASONING, _CONTENT = range(3)

    def __init__(self) -> None:
        self._state = self._HEAD
        self._held = ""
        self._after_end = False

    def feed(self, text: str) -> ReasoningDelta:
        held, out = self._held + text, ReasoningDelta()
        if self._state == self._HEAD:
            stripped = held.lstrip()
            if stripped.startswith(self.start):
                held, self._state = stripped[len(self.start):], self._REASONING
            elif self.start.startswith(stripped):  # undecided yet
                self._held = held
                return out
            else:
                self._state = self._REASONING if self.opened else self._CONTENT
        if self._state == self._REASONING:
            end = held.find(self.end)
            if end < 0:
                keep = partial_marker(held, self.end)
                out.reasoning, self._held = held[:len(held) - keep], held[len(held) - keep:]
                return out
            out.reasoning, held = held[:end], held[end + len(self.end):]
            self._state, self._after_end = self._CONTENT, True
        if self._after_end:
            held = held.lstrip()
            self._after_end = not held
        out.content, self._held = held, ""
        return out

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        reasoning = self._state == self._REASONING or (self._state == self._HEAD and self.opened)
        return ReasoningDelta(reasoning=held) if reasoning else ReasoningDelta(content=held)
