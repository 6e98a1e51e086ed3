"""Reasoning parsers on text: the bundled ``qwen3`` and ``deepseek_r1``, whole and streamed.

A streamed reply must split as the whole one does, however it is cut: each case is fed whole,
in two pieces at every split point, and one character at a time. (The server end to end:
tests/test_server_tools.py.)"""

from __future__ import annotations

import pytest

from hookllm.bundled.reasoning_parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from hookllm.plugins.components import ComponentKind
from hookllm.plugins.reasoning_parser import ReasoningDelta, ReasoningParser
from hookllm.server.reply_parsing import installed_plugins


def cuts(text: str) -> list[list[str]]:
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


def assert_splits(make: type[ReasoningParser], text: str, reasoning: str | None, content: str | None) -> None:
    assert make().parse(text) == (reasoning, content)
    for pieces in cuts(text):
        parser = make()
        delta = ReasoningDelta()
        for piece in pieces:
            delta = delta.merged(parser.feed(piece))
        delta = delta.merged(parser.finish())
        assert (delta.reasoning or None, delta.content or None) == (reasoning, content), pieces


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "Hello!"),
    ("\n<think>short</think>Answer", "short", "Answer"),
    ("No thinking here.", None, "No thinking here."),
    ("  leading space, no think", None, "  leading space, no think"),
    ("Text then <think>x</think>", None, "Text then <think>x</think>"),  # only a reply's beginning opens it
    ("<think>cut short by max_tokens", "cut short by max_tokens", None),
    ("<think>a < b </thin", "a < b </thin", None),
    ("<think></think>", None, None),
    ("<thi", None, "<thi"),
])
def test_qwen3(text, reasoning, content):
    assert_splits(Qwen3ReasoningParser, text, reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", [
    ("The template opened it.</think>\n\nParis.", "The template opened it.", "Paris."),
    ("<think>An explicit start.</think>Paris.", "An explicit start.", "Paris."),
    ("Still thinking when cut", "Still thinking when cut", None),
    ("Thought.</think>", "Thought.", None),
    ("<thi", "<thi", None),
])
def test_deepseek_r1(text, reasoning, content):
    assert_splits(DeepSeekR1ReasoningParser, text, reasoning, content)


def test_reasoning_streams_as_it_comes():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.feed("nk>Let me see") == ReasoningDelta(reasoning="Let me see")
    assert parser.feed(" more </th") == ReasoningDelta(reasoning=" more ")
    assert parser.feed("ink>\n") == ReasoningDelta()
    assert parser.feed("\nParis") == ReasoningDelta(content="Paris")


def test_the_bundled_reasoning_parsers_are_installed():
    manager = installed_plugins()
    assert manager.component(ComponentKind.REASONING_PARSER, "qwen3") is Qwen3ReasoningParser
    assert manager.component(ComponentKind.REASONING_PARSER, "deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="no installed plugin provides a reasoning parser named 'o1'"):
        manager.component(ComponentKind.REASONING_PARSER, "o1")
