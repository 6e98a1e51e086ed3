"""Tool parsers: a model's tool calls out of its reply text, for ``hookllm serve --tool-call-parser``.

The bundled parsers, registered through ``register_components`` (a hook called on every
installed plugin, so they need no ``--plugin``):

- ``hermes``: Hermes 2/3, Qwen2.5 and Qwen3 write each call as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per reply, with or
  without text around them;
- ``llama3_json``: Llama 3.1/3.2/3.3 answer a call with the JSON object
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several separated
  by ``;``. A reply that does not begin with one is content.

Both are built from the parser API's blocks (:mod:`hookllm.plugins.tool_parser`), as a plugin
adding a parser would.
"""

from __future__ import annotations

from hookllm.plugins.components import Components
from hookllm.plugins.hookspecs import hookimpl
from hookllm.plugins.tool_parser import JsonCallsParser, ParsedToolCall, TaggedToolParser, json_call


class HermesToolParser(TaggedToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse_call(self, body: str) -> ParsedToolCall | None:
        return json_call(body)


class Llama3JsonToolParser(JsonCallsParser):
    # With skip_special_tokens (the default) the tag never reaches the text; without, it leads the calls.
    opening, separator = "<|python_tag|>", ";"


@hookimpl
def register_components(components: Components) -> None:
    components.add_tool_parser("hermes", HermesToolParser)
    components.add_tool_parser("llama3_json", Llama3JsonToolParser)
