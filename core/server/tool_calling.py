"""A chat request's ``tools`` and ``tool_choice``: what the chat template sees, how the output is
constrained, and how each reply is parsed (:func:`chat_tools`).

``tool_choice`` (absent: ``"auto"`` with tools, ``"none"`` without, as OpenAI and vLLM):

- ``"none"``: no call; the replies are content, and the chat template gets no tools (a model
  shown tools it may not call tends to call them anyway);
- ``"auto"``: the model decides; the template gets the tools and the server's
  ``--tool-call-parser`` finds the calls in each reply (without one, a 400);
- ``"required"`` and a named function ``{"type": "function", "function": {"name": ...}}``: the
  output is constrained to a JSON schema by an active plugin whose structured output backend
  enforces ``json`` (registered through ``register_components``), so the calls always
  exist and their arguments validate against the functions' schemas, on any model (unless
  ``max_tokens`` cuts the reply short). A named
  function's reply is its arguments (the function's ``parameters`` schema); a required reply is
  a JSON array (``minItems`` 1) of ``{"name": <a tool's name>, "parameters": <its schema>}``
  objects, as vLLM constrains them. The JSON is on one line, with ``json.dumps``' separators
  (a named function's schema may set its own ``x-guidance`` layout options). No reasoning
  section is parsed from these replies: the constraint holds from their first token.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hookllm.plugins.manager import PluginManager
from hookllm.plugins.reasoning_parser import ReasoningParser
from hookllm.plugins.tool_parser import JsonCallsParser, ParsedDelta, ToolCallDelta, ToolParser
from hookllm.sampling_params import SamplingParams, StructuredOutputsParams
from hookllm.server.errors import OpenAIError
from hookllm.server.protocol import ChatCompletionRequest, ChatTool
from hookllm.server.reply_parsing import ReplyParser, reasoning_parser_class, tool_parser_class

if TYPE_CHECKING:
    from hookllm.server.state import ServerState

# The structured_outputs kind these choices need of a plugin's backend: a JSON schema.
JSON_SCHEMA = "json"
# The constrained JSON's layout (llguidance's options): on one line, with json.dumps' separators,
# as models are trained to write it (free whitespace would let a weak model pad it without end).
JSON_LAYOUT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
# A function without a parameters schema is called with {} (as vLLM does).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class RequiredToolParser(JsonCallsParser):
    """A ``tool_choice: "required"`` reply: ``[{"name": ..., "parameters": {...}}, ...]``."""

    opening, separator, closing = "[", ",", "]"


class NamedToolParser(ToolParser):
    """A named function's reply: the whole text is the arguments of one call to ``name``,
    streamed as they come."""

    def __init__(self, tools: list[dict[str, Any]], name: str) -> None:
        super().__init__(tools)
        self.name = name
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        name = None if self._started else self.name
        self._started = True
        return ParsedDelta(calls=[ToolCallDelta(0, name, text)])

    def finish(self) -> ParsedDelta:
        return ParsedDelta() if self._started else self.feed("")


@dataclass(frozen=True)
class ChatTools:
    """What a chat request's tools make of it: ``template_tools`` for the chat template,
    ``constraint`` on the output (None: none) from the schemas of ``constrained`` (a phrase
    naming the functions), and a new reply parser per choice (``replies``)."""

    template_tools: list[dict[str, Any]] | None
    replies: Callable[[], ReplyParser]
    constraint: StructuredOutputsParams | None = None
    constrained: str = ""

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the constraint; a 400 if the body asked for an output format of its own."""
        if self.constraint is None:
            return params
        if params.structured_outputs is not None:
            raise OpenAIError(400, 'tool_choice "required" or a named function constrains the output: it cannot '
                              "be combined with response_format or structured_outputs", param="tool_choice")
        return dataclasses.replace(params, structured_outputs=self.constraint)

    def explain(self, error: OpenAIError) -> OpenAIError:
        """The engine's refusal of the constraint (a schema llguidance cannot compile) as an error about ``tools``."""
        if self.constraint is None:
            return error
        _, marker, reason = error.message.partition(f"invalid structured_outputs.{self.constraint.kind}: ")
        if not marker:
            return error
        return OpenAIError(400, f"tools: the parameters schema of {self.constrained} does not compile: {reason}",
                           param="tools")


def chat_tools(state: ServerState, body: ChatCompletionRequest) -> ChatTools:
    """``body``'s tools and tool_choice checked (a 400 naming the problem) and put to use."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise OpenAIError(400, f"tool_choice {_describe(choice)} needs tools", param="tool_choice")
    definitions = [tool.model_dump(exclude_none=True) for tool in tools]
    max_calls = None if body.parallel_tool_calls else 1
    settings = state.settings
    reasoning = reasoning_parser_class(settings.reasoning_parser) if settings.reasoning_parser is not None else None
    if choice == "none":
        return ChatTools(None, _replies(reasoning, None, max_calls))
    if choice == "auto":
        if settings.tool_call_parser is None:
            raise OpenAIError(400, 'tool_choice "auto" needs a tool parser: start the server with '
                              "--tool-call-parser NAME (hookllm serve --help lists them)", param="tool_choice")
        parser = functools.partial(tool_parser_class(settings.tool_call_parser), definitions)
        return ChatTools(definitions, _replies(reasoning, parser, max_calls))
    _check_enforced(state, choice)
    if choice == "required":
        return ChatTools(definitions, _replies(None, functools.partial(RequiredToolParser, definitions), max_calls),
                         StructuredOutputsParams(json=_required_schema(tools, max_calls)),
                         "one of the functions " + ", ".join(repr(tool.function.name) for tool in tools))
    tool = next((tool for tool in tools if tool.function.name == choice.function.name), None)
    if tool is None:
        raise OpenAIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools "
                          f"({', '.join(t.function.name for t in tools)})", param="tool_choice")
    parser = functools.partial(NamedToolParser, definitions, tool.function.name)
    return ChatTools(definitions, _replies(None, parser, max_calls),
                     StructuredOutputsParams(json={**JSON_LAYOUT, **(tool.function.parameters or NO_PARAMETERS)}),
                     f"function {tool.function.name!r}")


def _replies(reasoning: type[ReasoningParser] | None, tools: Callable[[], ToolParser] | None,
             max_calls: int | None) -> Callable[[], ReplyParser]:
    """A new reply parser per call, each with parsers of its own."""
    return lambda: ReplyParser(reasoning() if reasoning else None, tools() if tools else None, max_calls)


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming function {choice.function.name!r}"


def _check_enforced(state: ServerState, choice: Any) -> None:
    """A 400 unless an active plugin's structured output backend enforces JSON schemas, which the choice needs."""
    hooks = state.engine.hooks
    if not any(info.name in hooks.active_names and JSON_SCHEMA in info.structured_output_kinds()
               for info in hooks.loaded):
        raise OpenAIError(400, f"tool_choice {_describe(choice)} is enforced with structured output, which no "
                          "active plugin provides: install llguidance (pip install 'hookllm[structured]'; "
                          "hookllm serve then activates the bundled structured plugin), or a plugin with a "
                          "structured output backend for JSON schemas (hookllm plugins lists them)",
                          param="tool_choice")


def _required_schema(tools: list[ChatTool], max_calls: int | None) -> dict[str, Any]:
    """The JSON schema of a ``required`` reply: an array of one or more calls, each naming one of
    ``tools`` with arguments for it. The functions' ``$defs`` move to the top, where their
    references (``#/$defs/...``) point."""
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        parameters = dict(tool.function.parameters or NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise OpenAIError(400, f"tools: two functions define $defs {name!r} differently; tool_choice "
                                  "'required' puts their schemas in one", param="tools")
        calls.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {**JSON_LAYOUT, "type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def with_json_schema_plugin(plugins: list[str], installed: PluginManager) -> list[str]:
    """``hookllm serve``'s plugins: ``plugins``, and unless one of them enforces JSON schemas, the
    first by name of the ``installed`` plugins that do (their structured output backends say
    so), for ``tool_choice`` "required" and named functions (and ``response_format``). Requests
    without a constraint should pay nothing for it (the bundled plugin's per-step hook returns at
    once when no request in the batch is constrained)."""
    capable = installed.structured_output_plugins(JSON_SCHEMA)
    if not capable or any(name in capable for name in plugins):
        return plugins
    return [*plugins, capable[0]]
