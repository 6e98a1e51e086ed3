"""Tool parsers on text: the bundled ``hermes`` and ``llama3_json``, the server's parsers of
``tool_choice`` "required" and a named function, and a reply's reasoning and calls together.

A streamed reply must give what the whole one gives, however it is cut: each case is fed whole,
in two pieces at every split point, and one character at a time."""

from __future__ import annotations

import json

import pytest

from hookllm import hookimpl
from hookllm.bundled.reasoning_parsers import Qwen3ReasoningParser
from hookllm.bundled.tool_parsers import HermesToolParser, Llama3JsonToolParser
from hookllm.plugins.components import ComponentKind
from hookllm.plugins.manager import PluginInfo, PluginManager
from hookllm.plugins.tool_parser import ParsedDelta, ParsedReply, ParsedToolCall, TaggedToolParser, ToolParser
from hookllm.server.reply_parsing import ReplyParser, installed_plugins
from hookllm.server.tool_calling import NamedToolParser, RequiredToolParser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
WEATHER_CALL = ParsedToolCall("get_weather", '{"city": "Paris", "days": 2}')
TIME_CALL = ParsedToolCall("get_time", '{"zone": "CET"}')


def cuts(text: str) -> list[list[str]]:
    """``text`` whole, in two pieces at every split point, and one character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


def streamed(make: type[ToolParser], pieces: list[str]) -> ParsedReply:
    parser = make([])
    delta = ParsedDelta()
    for piece in pieces:
        delta = delta.merged(parser.feed(piece))
    return ParsedReply.of(delta.merged(parser.finish()))


def assert_parses(make: type[ToolParser], text: str, content: str | None, calls: list[ParsedToolCall]) -> None:
    expected = ParsedReply(content, calls)
    assert make([]).parse(text) == expected
    for pieces in cuts(text):
        assert streamed(make, pieces) == expected, pieces


@pytest.mark.parametrize("text, content, calls", [
    ("Just an answer.", "Just an answer.", []),
    ("  spaces and a <b>tag</b> stay  \n", "  spaces and a <b>tag</b> stay  \n", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [WEATHER_CALL]),
    (f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
     '{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n', "Let me look.", [WEATHER_CALL, TIME_CALL]),
    (f"Before <tool_call>{WEATHER}</tool_call> after", "Before after", [WEATHER_CALL]),
    (f"<tool_call>{WEATHER}</tool_call>\n\nDone.", "\n\nDone.", [WEATHER_CALL]),
    # A model that stops instead of closing the call.
    (f"<tool_call>{WEATHER}", None, [WEATHER_CALL]),
    ('<tool_call>{"name": "ping"}</tool_call>', None, [ParsedToolCall("ping", "{}")]),
    ('<tool_call>{"name": "say", "arguments": {"text": "été {}"}}</tool_call>', None,
     [ParsedToolCall("say", '{"text": "été {}"}')]),
    # Not calls: they stay in the content, whole.
    ("a <tool_call>{not json}</tool_call> b", "a <tool_call>{not json}</tool_call> b", []),
    ("a <tool_call>{\"name\": ", "a <tool_call>{\"name\": ", []),
    ('x <tool_call>{"arguments": {}}</tool_call>', 'x <tool_call>{"arguments": {}}</tool_call>', []),
    ("ends with <tool_", "ends with <tool_", []),
])
def test_hermes(text, content, calls):
    assert_parses(HermesToolParser, text, content, calls)


def test_hermes_holds_back_only_what_may_start_a_call():
    parser = HermesToolParser([])
    assert parser.feed("Hello wor").content == "Hello wor"
    assert parser.feed("ld <tool").content == "ld"  # " <tool" may begin a call
    assert parser.feed("s are fine").content == " <tools are fine"
    assert parser.feed(f"<tool_call>{WEATHER[:20]}") == ParsedDelta()
    assert parser.feed(f"{WEATHER[20:]}</tool_call>").calls[0].name == "get_weather"


@pytest.mark.parametrize("text, content, calls", [
    (WEATHER.replace("arguments", "parameters"), None, [WEATHER_CALL]),
    ("<|python_tag|>" + WEATHER.replace("arguments", "parameters"), None, [WEATHER_CALL]),
    (f' {WEATHER} ; {{"name": "get_time", "parameters": {{"zone": "CET"}}}};\n', None, [WEATHER_CALL, TIME_CALL]),
    ('{"name": "f", "parameters": {"s": "a;b}{\\"c"}}', None, [ParsedToolCall("f", '{"s": "a;b}{\\"c"}')]),
    # Not a reply of calls: all content.
    ("The weather is fine.", "The weather is fine.", []),
    ('  {"answer": 42}', '  {"answer": 42}', []),
    ('{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),
    ("<|python_ta", "<|python_ta", []),
    ("", None, []),
    # After the calls, what does not fit the format is content.
    (f"{WEATHER} and more", " and more", [WEATHER_CALL]),
    (f'{WEATHER}; {{"name": ', '; {"name": ', [WEATHER_CALL]),
])
def test_llama3_json(text, content, calls):
    assert_parses(Llama3JsonToolParser, text, content, calls)


def test_required_choice_parser_reads_the_constrained_array():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "get_time", "parameters": {"zone": "CET"}}]'
    assert_parses(RequiredToolParser, text, None, [WEATHER_CALL, TIME_CALL])
    # Cut by max_tokens: the whole calls, and the rest as content.
    assert_parses(RequiredToolParser, text[:-10], text[text.index(", {"):-10], [WEATHER_CALL])


def test_named_choice_parser_streams_the_arguments():
    def named(tools):
        return NamedToolParser(tools, "get_weather")

    assert_parses(named, '{"city": "Paris", "days": 2}', None, [WEATHER_CALL])
    parser = named([])
    first, second = parser.feed('{"city": '), parser.feed('"Paris"}')
    assert (first.calls[0].name, first.calls[0].arguments) == ("get_weather", '{"city": ')
    assert (second.calls[0].name, second.calls[0].arguments) == (None, '"Paris"}')


def reply_parser() -> ReplyParser:
    return ReplyParser(Qwen3ReasoningParser(), HermesToolParser([]))


def test_a_reply_with_reasoning_and_calls_streams_as_it_parses_whole():
    text = f"<think>The user wants weather.</think>\n\nChecking.<tool_call>{WEATHER}</tool_call>"
    whole = reply_parser().parse(text)
    assert (whole.reasoning_content, whole.content) == ("The user wants weather.", "Checking.")
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
        ("get_weather", WEATHER_CALL.arguments)]
    for pieces in cuts(text):
        parser = reply_parser()
        deltas = [parser.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert "".join(d.reasoning_content or "" for d in deltas) == whole.reasoning_content
        assert "".join(d.content or "" for d in deltas) == whole.content
        calls = [call for d in deltas for call in d.tool_calls or []]
        assert [(c.index, c.type, c.function.name) for c in calls[:1]] == [(0, "function", "get_weather")]
        assert calls[0].id.startswith("call_") and all(c.id is None for c in calls[1:])
        assert "".join(c.function.arguments for c in calls) == WEATHER_CALL.arguments
        assert parser.called


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    message = ReplyParser(None, HermesToolParser([]), max_calls=1).parse(text)
    assert len(message.tool_calls) == 1 and message.content is None


def test_a_reply_without_parsers_is_its_text():
    message = ReplyParser(None, None).parse("<think>x</think><tool_call>{}</tool_call>")
    assert message.content == "<think>x</think><tool_call>{}</tool_call>"
    assert message.tool_calls is None and message.reasoning_content is None
    assert ReplyParser(None, None).parse("").content == ""


class CallTagParser(TaggedToolParser):  # docs/plugins.md's example
    start, end = "<call>", "</call>"

    def parse_call(self, body):
        name, _, arguments = body.strip().partition(" ")
        return ParsedToolCall(name, arguments or "{}") if name else None


class CallTagPlugin:
    @staticmethod
    @hookimpl
    def register_components(components):
        components.add_tool_parser("calltag", CallTagParser)


def test_a_plugin_parser_is_found_by_name_without_selecting_the_plugin():
    manager = PluginManager({"calltag": PluginInfo("calltag", CallTagPlugin)})
    assert manager.component(ComponentKind.TOOL_PARSER, "calltag") is CallTagParser
    assert_parses(CallTagParser, 'Sure. <call>get_time {"zone": "CET"}</call>', "Sure.", [TIME_CALL])


def test_the_bundled_parsers_are_installed_and_an_unknown_or_doubled_name_is_refused():
    assert installed_plugins().component(ComponentKind.TOOL_PARSER, "hermes") is HermesToolParser
    assert installed_plugins().component(ComponentKind.TOOL_PARSER, "llama3_json") is Llama3JsonToolParser
    with pytest.raises(ValueError, match="no installed plugin provides a tool parser named 'nope'; "
                                         "the tool parsers: .*hermes, llama3_json"):
        installed_plugins().component(ComponentKind.TOOL_PARSER, "nope")
    twin = type("Twin", (CallTagPlugin,), {})
    manager = PluginManager({"a": PluginInfo("a", CallTagPlugin), "b": PluginInfo("b", twin)})
    with pytest.raises(ValueError, match="'calltag' is registered by several plugins: a, b"):
        manager.component(ComponentKind.TOOL_PARSER, "calltag")


def test_arguments_are_json_text():
    message = reply_parser().parse(f"<tool_call>{WEATHER}</tool_call>")
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
