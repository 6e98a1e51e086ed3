"""``POST /v1/responses`` through the real ``openai`` client, against ``hookllm serve
--tool-call-parser hermes --reasoning-parser qwen3``: answers equal the chat endpoint's for the
same conversation, the stream's events build the same Response, reasoning and function calls
become their items, and what the server cannot honour is a 400 naming the field.

As in test_server_tools.py, the tiny random model's output is pinned with ``structured_outputs``
(a Hermes / Qwen3 style reply) where the parsers must find something in it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import types

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from hookllm.engine.async_llm import EngineStepError
from hookllm.server.protocol import (ChatCompletionChunk, ChatStreamChoice, DeltaFunctionCall, DeltaMessage,
                                     DeltaToolCall)
from hookllm.server.protocol_responses import ResponsesRequest
from hookllm.server.serving_responses import ResponsesRun
from server_fixtures import Server, with_chat_template

pytest.importorskip("llguidance")  # text.format and named tool_choice go through the structured plugin

# Shows an assistant's calls and the call a tool message answers, so that they change the prompt.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
            "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }} "
            "{{ c.function.arguments | tojson }}</call>{% endfor %}"
            "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")

SCHEMA = {  # completes in a few tokens even on the tiny random model
    "type": "object",
    "x-guidance": {"whitespace_flexible": False},
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
    "required": ["color", "size"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
PING = {"type": "function", "name": "ping"}
REASONED = "<think>\nRainy, surely.\n</think>\n\nIt rains."
CALLED = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
IMAGE = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5"
         "ErkJggg==")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    model = with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("responses-llama") / "model", TEMPLATE)
    server = Server([str(model), "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64",
                     "--served-model-name", "tiny", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int, **kwargs) -> tuple[str, str]:
    """The chat endpoint's answer to ``messages``: its text and finish reason."""
    choice = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                            **kwargs).choices[0]
    return choice.message.content, choice.finish_reason


def test_text_response_equals_chat_and_echoes_the_request(server, client):
    response = client.responses.create(model="tiny", instructions="Be brief.", input="Say something",
                                       max_output_tokens=12, temperature=0, metadata={"run": "1"})
    chat = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}])
    assert response.output_text == chat.choices[0].message.content
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(part.type, part.annotations) for part in message.content] == [("output_text", [])]
    assert chat.choices[0].finish_reason == "length"  # the tiny random model rambles on
    assert response.status == message.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert (response.instructions, response.max_output_tokens, response.temperature, response.top_p) == (
        "Be brief.", 12, 0, 1)
    assert (response.tools, response.tool_choice, response.parallel_tool_calls) == ([], "auto", True)
    assert response.text.format.type == "text" and response.metadata == {"run": "1"}
    assert response.store is True and response.previous_response_id is None
    # The client parses leniently: the body must also validate as its Response type.
    raw = httpx.post(server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2})
    Response.model_validate(raw.json())


def test_streamed_events_build_the_unstreamed_response(client):
    kwargs = dict(model="tiny", input="Say something", max_output_tokens=10, temperature=0)
    expected = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:-2] if hasattr(e, "item_id")} == {item_id} and events[-2].item.id == item_id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-3].part.text == expected.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.status == "incomplete"
    assert final.output_text == text and final.output[0].id == item_id and final.output[0].status == "incomplete"
    assert final.usage.output_tokens == expected.usage.output_tokens


def test_json_schema_text_format_and_the_stream_helper(client):
    text = {"format": {"type": "json_schema", "name": "color", "schema": SCHEMA, "strict": True}}
    kwargs = dict(model="tiny", input="A color as JSON", text=text, max_output_tokens=40, temperature=0)
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    assert final.text.format.type == "json_schema" and final.text.format.schema_ == SCHEMA
    assert client.responses.create(**kwargs).output_text == final.output_text


def test_input_items_are_the_chat_conversation(client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "you"}]},
             {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
              "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}]},
             {"type": "message", "role": "user", "content": "Again"}]
    messages = [{"role": "system", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]},
                {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Again"}]
    response = client.responses.create(model="tiny", input=items, max_output_tokens=8, temperature=0)
    assert response.output_text == chat_text(client, messages, 8, temperature=0)[0]


def test_extra_body_sampling_fields_reach_the_engine(client):
    extra = {"seed": 5, "top_k": 20}
    response = client.responses.create(model="tiny", input="Hello", max_output_tokens=8, temperature=1.0,
                                       extra_body=extra)
    expected = chat_text(client, [{"role": "user", "content": "Hello"}], 8, temperature=1.0, extra_body=extra)[0]
    assert response.output_text == expected


def pinned(reply: str) -> dict:
    """extra_body pinning the model's reply to ``reply``."""
    return {"structured_outputs": {"choice": [reply]}}


def events_of(client: openai.OpenAI, **kwargs) -> list:
    """A streamed response's events, checked for what every stream holds."""
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def item_events(events: list, item) -> list[str]:
    """The types of the events about ``item`` (one output item, by its id)."""
    return [e.type for e in events if getattr(e, "item_id", None) == item.id or
            getattr(getattr(e, "item", None), "id", None) == item.id]


def test_reasoning_is_an_item_of_its_own_and_is_left_out_of_the_next_turn(client):
    kwargs = dict(model="tiny", input="Weather?", max_output_tokens=60, temperature=0, extra_body=pinned(REASONED))
    response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", "\nRainy, surely.\n")]
    assert response.output_text == "It rains." and response.status == "completed"

    events = events_of(client, **kwargs)
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == "It rains."
    streamed_reasoning, streamed_message = final.output
    assert streamed_reasoning.content == reasoning.content
    deltas = item_events(events, streamed_reasoning).count("response.reasoning_text.delta")
    assert item_events(events, streamed_reasoning) == [
        "response.output_item.added", "response.content_part.added", *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert events.index(next(e for e in events if e.type == "response.output_item.done")) < events.index(
        next(e for e in events if getattr(e, "item_id", None) == streamed_message.id))  # one item after the other

    # The output items given back as they are, as OpenAI's guide does (input += response.output).
    turn = [{"role": "user", "content": "Weather?"}, *response.output, {"role": "user", "content": "Tomorrow?"}]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It rains."},
                {"role": "user", "content": "Tomorrow?"}]
    answer = client.responses.create(model="tiny", input=turn, max_output_tokens=6, temperature=0)
    assert answer.output_text == chat_text(client, messages, 6, temperature=0)[0]


def test_parsed_function_calls_are_items_after_the_message(client):
    kwargs = dict(model="tiny", input="Weather in Rome?", tools=[WEATHER, PING], max_output_tokens=200,
                  temperature=0, extra_body=pinned(CALLED))
    response = client.responses.create(**kwargs)
    message, *calls = response.output
    assert message.type == "message" and response.output_text == "I will check."
    assert [(c.type, c.name, c.arguments) for c in calls] == [
        ("function_call", "get_weather", '{"city": "Rome"}'), ("function_call", "ping", "{}")]
    assert len({c.call_id for c in calls}) == 2
    assert response.status == "completed" and all(c.status == "completed" for c in response.output)

    events = events_of(client, **kwargs)
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output_text == "I will check."
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output]
    for call in final.output[1:]:
        assert item_events(events, call)[0] == "response.output_item.added"
        assert item_events(events, call)[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.item_id == call.id]
        assert "".join(deltas) == call.arguments


def test_a_named_function_is_called_and_its_output_answered(client):
    kwargs = dict(model="tiny", input="The weather in Paris?", tools=[WEATHER], max_output_tokens=40,
                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    response = client.responses.create(**kwargs)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.status == "completed" and response.output_text == ""
    assert response.tools[0].name == "get_weather" and response.tool_choice.name == "get_weather"

    events = events_of(client, **kwargs)
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    assert (done.name, done.arguments) == (call.name, call.arguments) and events[-1].type == "response.completed"
    (streamed,) = events[-1].response.output
    assert (streamed.name, streamed.arguments, streamed.id) == (call.name, call.arguments, done.item_id)

    turn = [{"role": "user", "content": "The weather in Paris?"}, call,
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model="tiny", input=turn, max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": "The weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    without_call = client.chat.completions.create(model="tiny", messages=messages[:1], max_tokens=1)
    assert answer.usage.input_tokens > without_call.usage.prompt_tokens + 10  # the call and its output count


@pytest.mark.parametrize("body, status, param", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"background": True}, 400, "background"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, 400, "tool_choice"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, 400,
     "input.0.message.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}]}, 400, "input"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_k": -5}, 400, "top_k"),
    ({"model": "nope"}, 404, "model"),
], ids=lambda value: None if isinstance(value, (dict, int)) else value)
def test_what_cannot_be_honoured_is_an_error_naming_the_field(server, client, body, status, param):
    response = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "x", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert client.responses.create(model="tiny", input="ok", max_output_tokens=2).status == "incomplete"


def test_fields_that_ask_for_nothing_are_accepted(client):
    response = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False, background=False,
                                       include=[], truncation="disabled", reasoning={"effort": None},
                                       service_tier="auto", user="u", text={"format": {"type": "text"}},
                                       parallel_tool_calls=None, extra_body={"stream": None, "conversation": None})
    assert response.status == "incomplete" and response.store is False and response.user == "u"
    assert response.parallel_tool_calls is True


def test_responses_are_not_stored(server, client):
    response = client.responses.create(model="tiny", input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    for method, path in [("DELETE", ""), ("GET", "/input_items"), ("POST", "/cancel")]:
        answer = httpx.request(method, f"{server.url}/v1/responses/{response.id}{path}")
        assert answer.status_code == 404 and "does not store" in answer.json()["error"]["message"]


def test_a_dropped_stream_is_aborted_and_its_blocks_freed(server):
    aborted = server.metric("hookllm:request_success_total", 'finished_reason="abort"')
    body = json.dumps({"input": "a long story", "max_output_tokens": 400, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10
    while (server.metric("hookllm:request_success_total", 'finished_reason="abort"') == aborted
           or server.metric("hookllm:num_used_kv_blocks") > 0):
        assert time.monotonic() < deadline, "the dropped stream's request is still running"
        time.sleep(0.05)


def test_an_engine_failure_mid_stream_ends_it_with_response_failed():
    """No server: a chat run whose engine step fails after a reasoning, a text and a call delta.
    Every event also validates as the openai package's own event type."""
    deltas = [DeltaMessage(reasoning_content="hmm"), DeltaMessage(content="Hi"),
              DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="call_1", type="function",
                                                     function=DeltaFunctionCall(name="f", arguments='{"a"'))])]

    async def chunks():
        for delta in deltas:
            yield ChatCompletionChunk(id="c", model="tiny", choices=[ChatStreamChoice(index=0, delta=delta)])
        raise EngineStepError("a plugin raised")

    body = ResponsesRequest(input="x", tools=[{"type": "function", "name": "f"}])
    run = ResponsesRun(body, types.SimpleNamespace(name="tiny", chunks=chunks), "resp_1", 0)

    async def collect() -> list:
        return [event async for event in run.events()]

    events = asyncio.run(collect())
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event.model_dump(by_alias=True))
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        *item, "response.reasoning_text.delta", "response.reasoning_text.done", *done,
        *item, "response.output_text.delta", "response.output_text.done", *done,
        "response.output_item.added", "response.function_call_arguments.delta", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message == "a plugin raised"
    assert [(item.type, item.status) for item in failed.output] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "incomplete")]
    assert failed.output[2].arguments == '{"a"'
