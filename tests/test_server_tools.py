"""Tool calling, reasoning and ``n`` choices on ``/v1/chat/completions``, through the real ``openai``
client against ``hookllm serve --tool-call-parser hermes --reasoning-parser qwen3``.

The tiny random model makes no tool call of its own: ``tool_choice`` "required" and a named
function constrain it (so any model calls them, with arguments valid for the schema), and the
``auto`` and reasoning tests pin its output with vLLM's ``structured_outputs`` body field to a
text written the way a Hermes / Qwen3 model writes it, which the server's parsers then read.
The parsers on text, at every split point: tests/test_tool_parsers.py, test_reasoning_parsers.py.
"""

from __future__ import annotations

import json
import types

import httpx
import jsonschema
import openai
import pytest

from hookllm import LLM, SamplingParams
from hookllm.server.errors import OpenAIError
from hookllm.server.protocol import ChatCompletionRequest
from hookllm.server.state import ServerSettings
from hookllm.server.tool_calling import chat_tools
from server_fixtures import Server, with_chat_template

pytest.importorskip("llguidance")

# A template that shows the tools, an assistant's calls (arguments as objects) and tool results.
# (The tools' names only: the tiny model's context is short.)
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
            "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
NUM_KV_BLOCKS = 128


def function(name: str, parameters: dict | None = None) -> dict:
    definition = {"name": name, "description": f"{name}: a tool"}
    if parameters is not None:
        definition["parameters"] = parameters
    return {"type": "function", "function": definition}


# Small schemas, so that the random model completes them in a few tokens.
WEATHER = function("get_weather", {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}})
CONVERT = function("convert", {
    "type": "object", "additionalProperties": False, "required": ["unit", "value"],
    "properties": {"unit": {"$ref": "#/$defs/unit"}, "value": {"type": "integer", "minimum": 0, "maximum": 99}},
    "$defs": {"unit": {"enum": ["C", "F"]}}})
PING = function("ping")  # no parameters: called with {}
TOOLS = [WEATHER, CONVERT, PING]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "maxProperties": 0})
           for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("tools-llama") / "model", TEMPLATE)


@pytest.fixture(scope="module")
def server(model_dir):
    # No --plugin structured: hookllm serve activates it (llguidance is installed).
    server = Server([str(model_dir), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                     "--served-model-name", "tiny", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_valid_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, **kwargs) -> dict:
    """A streamed chat's choices, each assembled from its deltas as a client does."""
    choices: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            got = choices.setdefault(choice.index, {"roles": [], "content": "", "reasoning": "", "calls": {},
                                                    "finish_reason": None})
            delta = choice.delta
            got["roles"] += [delta.role] if delta.role else []
            got["content"] += delta.content or ""
            got["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.id is not None:  # a call's first delta: its id, type and name
                    assert call.index not in got["calls"] and call.type == "function" and call.function.name
                    got["calls"][call.index] = types.SimpleNamespace(
                        id=call.id, type=call.type,
                        function=types.SimpleNamespace(name=call.function.name, arguments=""))
                got["calls"][call.index].function.arguments += call.function.arguments or ""
            got["finish_reason"] = choice.finish_reason or got["finish_reason"]
    return choices


@pytest.mark.parametrize("seed", range(2))
def test_a_named_function_is_called_with_valid_arguments(client, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                  max_tokens=120)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    assert_valid_calls(reply.message.tool_calls, {"get_weather"})
    assert len(reply.message.tool_calls) == 1
    (stream,) = streamed(client, **kwargs).values()
    assert stream["roles"] == ["assistant"] and stream["finish_reason"] == "tool_calls" and stream["content"] == ""
    assert [(c.function.name, c.function.arguments) for c in stream["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert_valid_calls(stream["calls"].values(), {"get_weather"})


@pytest.mark.parametrize("seed", range(2))
def test_required_calls_one_or_more_tools_with_valid_arguments(client, seed):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                  max_tokens=200)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert_valid_calls(reply.message.tool_calls, set(SCHEMAS))
    (stream,) = streamed(client, **kwargs).values()
    assert stream["finish_reason"] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in stream["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls]


def test_parallel_tool_calls_false_makes_one_call(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=0, max_tokens=120)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_n_choices_are_parsed_each_and_counted_in_usage(client):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7,
                  max_tokens=200, n=3)
    reply = client.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message.tool_calls, set(SCHEMAS))
    stream = streamed(client, stream_options={"include_usage": True}, **kwargs)
    assert sorted(stream) == [0, 1, 2] and all(got["roles"] == ["assistant"] for got in stream.values())
    assert [[(c.function.name, c.function.arguments) for c in stream[i]["calls"].values()] for i in range(3)] == [
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] for choice in reply.choices]


def test_n_plain_choices_equal_offline_chat_with_usage(client, offline):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12)
    expected = offline.chat(MESSAGES, params)[0]
    kwargs = dict(model="tiny", messages=MESSAGES, n=2, temperature=1.0, seed=3, max_tokens=12)
    reply = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in reply.choices] == [o.text for o in expected.outputs]
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for o in expected.outputs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = ["", ""]
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [o.text for o in expected.outputs]
    assert chunks[-1].usage == reply.usage


HERMES_REPLY = ('On it.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>\n'
                '<tool_call>{"name": "ping"}</tool_call>')


def test_auto_parses_the_calls_a_model_writes(client):
    # The reply is pinned to what a Hermes-style model writes; the server's hermes parser reads it.
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0.0,
                  extra_body={"structured_outputs": {"choice": [HERMES_REPLY]}})
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == "On it."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 3}), ("ping", {})]
    (stream,) = streamed(client, **kwargs).values()
    assert stream["content"] == "On it." and stream["finish_reason"] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in stream["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls]


def test_reasoning_is_split_from_the_content(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=100, temperature=0.0,
                  extra_body={"structured_outputs": {"choice": ["<think>\nRainy.\n</think>\n\nIt rains."]}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.reasoning_content, message.content) == ("\nRainy.\n", "It rains.")
    (stream,) = streamed(client, **kwargs).values()
    assert (stream["reasoning"], stream["content"]) == ("\nRainy.\n", "It rains.")


def test_tools_reach_the_template_unless_tool_choice_is_none(client, offline):
    def prompt_tokens(tools: list | None) -> int:
        text = offline.tokenizer.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False)
        return len(offline.tokenizer(text, add_special_tokens=False)["input_ids"])

    required = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              max_tokens=120, temperature=0.0)
    assert required.usage.prompt_tokens == prompt_tokens(TOOLS)
    none = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=4, temperature=0.0)
    assert none.usage.prompt_tokens == prompt_tokens(None) and none.choices[0].message.tool_calls is None


def test_a_conversation_with_tool_calls_and_results_reaches_the_template(server, client):
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    # (The template's blocks eat the newlines after them.)
    assert '<assistant><call>get_weather {"city": "Paris", "days": 2}</call><tool>sunny [call_1]<assistant>' in text
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=4, temperature=0.0)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice",
     "names function 'fly', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice", "needs tools"),
    ({"tools": [function("broken", {"type": "object", "properties": {"a": {"type": "nonsense"}}})],
      "tool_choice": "required"}, "tools", "schema of one of the functions 'broken' does not compile: Invalid type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "ping"}},
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined with response_format"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", "Field"),
], ids=["unknown-function", "required-without-tools", "named-without-tools", "schema-does-not-compile",
        "with-response-format", "function-without-name"])
def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(server, client, body, param, message):
    response = httpx.post(server.url + "/v1/chat/completions",
                          json={"model": "tiny", "messages": MESSAGES, "max_tokens": 8, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "ping"}},
                                           max_tokens=8, temperature=0.0)
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {}
    assert server.metric("hookllm:num_used_kv_blocks") == 0


def fake_state(active: list[str], **settings) -> types.SimpleNamespace:
    """What chat_tools reads of a ServerState: the settings, and the engine's active plugins."""
    from hookllm.server.reply_parsing import installed_plugins

    hooks = types.SimpleNamespace(loaded=installed_plugins().loaded(), active_names=frozenset(active))
    return types.SimpleNamespace(settings=ServerSettings(served_model_names=["x"], **settings),
                                 engine=types.SimpleNamespace(hooks=hooks))


def test_auto_needs_a_tool_parser_and_required_needs_structured_output():
    body = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)  # tool_choice defaults to auto with tools
    with pytest.raises(OpenAIError, match="start the server with --tool-call-parser") as error:
        chat_tools(fake_state(["core", "structured"]), body)
    assert (error.value.status, error.value.param) == (400, "tool_choice")
    assert chat_tools(fake_state([], tool_call_parser="hermes"), body).constraint is None
    required = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS, tool_choice="required")
    with pytest.raises(OpenAIError, match="install llguidance .* or a plugin with a structured output backend"):
        chat_tools(fake_state(["core"]), required)
    assert chat_tools(fake_state(["core", "structured"]), required).constraint is not None
    plain = ChatCompletionRequest(messages=MESSAGES)
    assert chat_tools(fake_state([]), plain).template_tools is None


def test_serve_activates_the_structured_plugin_and_checks_parser_names(capsys):
    from hookllm.entrypoints.cli import main
    from hookllm.server.reply_parsing import installed_plugins
    from hookllm.server.tool_calling import with_json_schema_plugin

    assert with_json_schema_plugin(["llava"], installed_plugins()) == ["llava", "structured"]
    assert with_json_schema_plugin(["structured"], installed_plugins()) == ["structured"]
    for flag, what in (("--tool-call-parser", "tool parser"), ("--reasoning-parser", "reasoning parser")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", flag, "nope"])
        assert exit_.value.code == 2
        assert f"{flag}: no installed plugin provides a {what} named 'nope'" in capsys.readouterr().err
