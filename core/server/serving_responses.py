"""``POST /v1/responses``, OpenAI's Responses API, on the chat pipeline: the body becomes a
``ChatCompletionRequest`` (``instructions`` a system message, input items chat messages, flat
function tools chat's nested ones, ``text.format`` a ``response_format``) run by ``start_chat``,
and its answer becomes a Response object, or its chunks the Responses stream's semantic events.

Fields the server cannot honour are a 400 naming them. Nothing is stored (``store`` is accepted
and changes nothing), so the routes of a stored response answer 404.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, ClassVar, NoReturn

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from hookllm.engine.async_llm import EngineDeadError, EngineStepError
from hookllm.server.errors import OpenAIError, engine_error, error_responses, generation_responses
from hookllm.server.protocol import ChatCompletionRequest, ChatResponseMessage, DeltaMessage, SamplingFields
from hookllm.server.protocol_responses import (ContentPartEvent, FunctionCallArgumentsDelta, FunctionCallArgumentsDone,
                                               HostedTool, IncompleteDetails, InputFunctionCall,
                                               InputFunctionCallOutput, InputImage, InputMessage,
                                               InputText, ItemStatus, OutputFunctionCall, OutputItem,
                                               OutputItemEvent, OutputMessage, OutputReasoning, OutputReasoningText,
                                               OutputText, OutputTextDelta, OutputTextDone, ReasoningTextDelta,
                                               ReasoningTextDone, ResponseError, ResponseLifecycleEvent,
                                               ResponseObject, ResponsesRequest, ResponseUsage, StreamEvent,
                                               TextFormat)
from hookllm.server.serving_chat import ChatRun, start_chat
from hookllm.server.state import ServerState, check_ignored, server_state
from hookllm.server.streaming import until_disconnect

router = APIRouter()

# Body fields beyond OpenAI's Responses API that go to the chat request as they are (through the
# openai client's extra_body): chat's sampling fields, less those a Response has one way to say
# (one output, no n), and its chat-template options. Plugins' options go too (ServerState.extra_args).
CHAT_FIELDS = (frozenset(SamplingFields.model_fields)
               - {"model", "temperature", "top_p", "n", "stream", "stream_options", "response_format"}
               | {"chat_template", "chat_template_kwargs"})

NOT_IMPLEMENTED = "not implemented by this server"
# OpenAI's Responses fields the server does not honour: (the values besides null, false, [] and
# objects of those that ask for nothing and are accepted, why any other value is a 400).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), "responses are not stored: send the whole conversation as input items"),
    "conversation": ((), "conversations are not stored: send the whole conversation as input items"),
    "background": ((), "a response runs while its request waits"),
    "include": ((), "no extra output (logprobs, encrypted reasoning, tool results) is returned"),
    "prompt": ((), "there are no stored prompt templates"),
    "reasoning": ((), "the chat template decides how the model reasons; pass its options as chat_template_kwargs"),
    "max_tool_calls": ((), "there are no built-in tools"),
    "truncation": (("disabled",), "an input too long for the model is a 400"),
    "top_logprobs": ((0,), "responses carry no logprobs (/v1/chat/completions does)"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    **{name: ((), NOT_IMPLEMENTED) for name in ("stream_options", "context_management", "moderation", "image",
                                                "prompt_cache_options", "prompt_cache_retention",
                                                "background_options", "access_programs")},
}

# Chat's fields as the Responses body names them, for the errors of the chat pipeline.
RESPONSES_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                    "messages": "input", "response_format": "text.format"}
CHAT_ROLES = {"developer": "system"}  # chat templates know system messages; developer is their newer name


@router.post("/v1/responses", response_model=None, responses=generation_responses(
    ResponseObject, "typed events (`response.created`, ..., `response.completed`)"))
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    check_supported(state, body)
    chat_body = chat_request(state, body)

    async def run() -> Response:
        response_id = f"resp_{uuid.uuid4().hex}"
        created_at = int(time.time())
        answer = ResponsesRun(body, await start(state, chat_body, response_id), response_id, created_at)
        return event_stream(answer.events()) if body.stream else await answer.response()

    return await until_disconnect(request, run())


@router.get("/v1/responses/{response_id}", response_model=None, responses=error_responses(404))
@router.delete("/v1/responses/{response_id}", response_model=None, responses=error_responses(404))
@router.get("/v1/responses/{response_id}/input_items", response_model=None, responses=error_responses(404))
@router.post("/v1/responses/{response_id}/cancel", response_model=None, responses=error_responses(404))
async def stored_response(response_id: str) -> NoReturn:
    """A stored response's routes: none is ever stored, so each one is not found."""
    raise OpenAIError(404, f"no response {response_id!r}: this server does not store responses",
                      param="response_id")


def check_supported(state: ServerState, body: ResponsesRequest) -> None:
    """A 400 naming the first field that asks for what the server does not do, or that it does not know."""
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED:
            accepted, why = UNSUPPORTED[name]
            if (param := asks_for(name, value, accepted)) is not None:
                raise OpenAIError(400, f"{param} is not supported: {why}", param=param)
        elif not passed_to_chat(state, name):
            check_ignored(name, value)
    for index, tool in enumerate(body.tools):
        if isinstance(tool, HostedTool):
            raise OpenAIError(400, f"tools[{index}]: {tool.type!r} tools are not supported: the server runs no "
                              f"built-in tools, only function tools", param="tools")
    if isinstance(body.tool_choice, dict):
        raise OpenAIError(400, f"tool_choice of type {body.tool_choice.get('type')!r} is not supported: give "
                          f"'none', 'auto', 'required' or a function", param="tool_choice")
    if body.text.verbosity not in (None, "medium"):
        raise OpenAIError(400, "text.verbosity is not supported: the model decides how much it says",
                          param="text.verbosity")


def asks_for(name: str, value: Any, accepted: tuple[Any, ...] = ()) -> str | None:
    """The field (dotted, inside objects) of ``value`` that asks for something, or None."""
    if value is None or value is False or value == [] or value in accepted:
        return None
    if isinstance(value, dict):
        return next((param for key, item in value.items() if (param := asks_for(f"{name}.{key}", item))), None)
    return name


def passed_to_chat(state: ServerState, name: str) -> bool:
    return name in CHAT_FIELDS or name in state.settings.plugin_options


def chat_request(state: ServerState, body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``body`` asks for; a value chat refuses is a 400 naming the Responses field."""
    fields = {name: value for name, value in (body.model_extra or {}).items() if passed_to_chat(state, name)}
    fields.update(model=body.model, messages=chat_messages(body), max_completion_tokens=body.max_output_tokens,
                  temperature=body.temperature, top_p=body.top_p, response_format=response_format(body.text.format),
                  stream=body.stream, stream_options={"include_usage": True} if body.stream else None)
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in body.tools]
    if "tool_choice" in body.model_fields_set:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                         "function": {"name": choice.name}}
    if "parallel_tool_calls" in body.model_fields_set:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    try:
        return ChatCompletionRequest.model_validate({name: value for name, value in fields.items()
                                                     if value is not None})
    except ValidationError as exc:
        errors = [{**error, "loc": responses_loc(error["loc"])} for error in exc.errors()]
        raise RequestValidationError(errors) from None


def responses_param(param: str | None) -> str | None:
    return RESPONSES_PARAMS.get(param, param)


def responses_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A chat request's error location, its field named as the Responses body names it."""
    return (responses_param(str(loc[0])), *loc[1:]) if loc else loc


def response_format(text_format: TextFormat) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format`` (Responses' schema fields are flat, chat's nested)."""
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    return {"type": "json_schema", "json_schema": text_format.model_dump(by_alias=True, exclude={"type"},
                                                                         exclude_none=True)}


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages: an answer's function calls join its
    assistant message, a function's output is a tool message. Reasoning items are left out: chat
    messages carry no reasoning (chat templates drop an earlier turn's)."""
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    for item in body.input:
        if isinstance(item, InputMessage):
            messages.append({"role": CHAT_ROLES.get(item.role, item.role), "content": chat_content(item.content)})
        elif isinstance(item, InputFunctionCall):
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, InputFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": chat_content(item.output)})
    return messages


def chat_content(content: list[InputText | InputImage]) -> list[dict[str, Any]]:
    """A Responses message's content as chat content: text parts, images as ``image_url`` parts."""
    return [chat_part(part) for part in content]


def chat_part(part: InputText | InputImage) -> dict[str, Any]:
    if isinstance(part, InputText):
        return {"type": "text", "text": part.text}
    if part.image_url is None:
        raise OpenAIError(400, "input_image needs an image_url (file_id names OpenAI's file storage, which this "
                          "server does not have)", param="input")
    return {"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}}


async def start(state: ServerState, body: ChatCompletionRequest, response_id: str) -> ChatRun:
    """``start_chat``, its errors naming the Responses body's fields."""
    try:
        return await start_chat(state, body, response_id)
    except OpenAIError as exc:
        exc.param = responses_param(exc.param)
        raise


class ItemBuilder:
    """One output item, built whole or delta by delta: ``added``, ``delta``s and ``done`` are its
    stream events, ``item`` the item itself."""

    prefix: ClassVar[str]

    def __init__(self, output_index: int, text: str = ""):
        self.id = f"{self.prefix}_{uuid.uuid4().hex}"
        self.output_index = output_index
        self.text = text

    def item(self, status: ItemStatus) -> OutputItem:
        raise NotImplementedError

    def added(self) -> list[StreamEvent]:
        return [OutputItemEvent(type="response.output_item.added", output_index=self.output_index,
                                item=self.item("in_progress")), *self._opened()]

    def delta(self, text: str) -> list[StreamEvent]:
        self.text += text
        return [self._delta(text)]

    def done(self, status: ItemStatus) -> list[StreamEvent]:
        return [*self._closed(), OutputItemEvent(type="response.output_item.done", output_index=self.output_index,
                                                 item=self.item(status))]

    def _opened(self) -> list[StreamEvent]:
        return []

    def _delta(self, text: str) -> StreamEvent:
        raise NotImplementedError

    def _closed(self) -> list[StreamEvent]:
        raise NotImplementedError


class TextItem(ItemBuilder):
    """An item holding one text content part (a message's answer, a reasoning item's reasoning)."""

    part: ClassVar[type[OutputText] | type[OutputReasoningText]]
    delta_event: ClassVar[type[OutputTextDelta] | type[ReasoningTextDelta]]
    done_event: ClassVar[type[OutputTextDone] | type[ReasoningTextDone]]

    def _content(self, status: ItemStatus) -> list[Any]:
        return [] if status == "in_progress" else [self.part(text=self.text)]

    def _opened(self) -> list[StreamEvent]:
        return [ContentPartEvent(type="response.content_part.added", item_id=self.id, output_index=self.output_index,
                                 part=self.part(text=""))]

    def _delta(self, text: str) -> StreamEvent:
        return self.delta_event(item_id=self.id, output_index=self.output_index, delta=text)

    def _closed(self) -> list[StreamEvent]:
        return [self.done_event(item_id=self.id, output_index=self.output_index, text=self.text),
                ContentPartEvent(type="response.content_part.done", item_id=self.id, output_index=self.output_index,
                                 part=self.part(text=self.text))]


class MessageItem(TextItem):
    prefix, part, delta_event, done_event = "msg", OutputText, OutputTextDelta, OutputTextDone

    def item(self, status: ItemStatus) -> OutputMessage:
        return OutputMessage(id=self.id, status=status, content=self._content(status))


class ReasoningItem(TextItem):
    prefix, part, delta_event, done_event = "rs", OutputReasoningText, ReasoningTextDelta, ReasoningTextDone

    def item(self, status: ItemStatus) -> OutputReasoning:
        return OutputReasoning(id=self.id, status=status, content=self._content(status))


class FunctionCallItem(ItemBuilder):
    """A function call; its text is the arguments (JSON)."""

    prefix = "fc"

    def __init__(self, output_index: int, call_id: str, name: str, arguments: str = ""):
        super().__init__(output_index, arguments)
        self.call_id, self.name = call_id, name

    def item(self, status: ItemStatus) -> OutputFunctionCall:
        return OutputFunctionCall(id=self.id, status=status, call_id=self.call_id, name=self.name, arguments=self.text)

    def _delta(self, text: str) -> StreamEvent:
        return FunctionCallArgumentsDelta(item_id=self.id, output_index=self.output_index, delta=text)

    def _closed(self) -> list[StreamEvent]:
        return [FunctionCallArgumentsDone(item_id=self.id, output_index=self.output_index, name=self.name,
                                          arguments=self.text)]


def message_items(message: ChatResponseMessage) -> list[ItemBuilder]:
    """A chat answer's output items: its reasoning, its text, its function calls; an empty
    message if it has none of them (the stream's ``OutputStream`` yields the same)."""
    items: list[ItemBuilder] = []
    if message.reasoning_content:
        items.append(ReasoningItem(len(items), message.reasoning_content))
    if message.content or not (items or message.tool_calls):
        items.append(MessageItem(len(items), message.content or ""))
    for call in message.tool_calls or []:
        items.append(FunctionCallItem(len(items), call.id, call.function.name, call.function.arguments))
    return items


class OutputStream:
    """Chat deltas as output items and their events: an item opens at its first delta and is
    done when the next one opens, or at ``finish``."""

    def __init__(self) -> None:
        self.items: list[ItemBuilder] = []
        self.calls: dict[int, FunctionCallItem] = {}  # by the chat delta's tool-call index

    def delta(self, delta: DeltaMessage) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if delta.reasoning_content:
            events += self._text(ReasoningItem, delta.reasoning_content)
        if delta.content:
            events += self._text(MessageItem, delta.content)
        for call in delta.tool_calls or []:
            if call.index not in self.calls:  # its first delta, with its id and name
                self.calls[call.index] = FunctionCallItem(len(self.items), call.id, call.function.name)
                events += self._open(self.calls[call.index])
            if call.function.arguments:
                events += self.calls[call.index].delta(call.function.arguments)
        return events

    def finish(self, status: ItemStatus) -> list[StreamEvent]:
        """The last item done with ``status`` (an empty message first if there was no item)."""
        events = [] if self.items else self._open(MessageItem(0))
        return events + self.items[-1].done(status)

    def _text(self, kind: type[TextItem], text: str) -> list[StreamEvent]:
        events = [] if self.items and type(self.items[-1]) is kind else self._open(kind(len(self.items)))
        return events + self.items[-1].delta(text)

    def _open(self, item: ItemBuilder) -> list[StreamEvent]:
        events = self.items[-1].done("completed") if self.items else []
        self.items.append(item)
        return events + item.added()


@dataclass
class ResponsesRun:
    """A started response: its Response object whole (``response``) or its stream events (``events``)."""

    body: ResponsesRequest
    chat: ChatRun
    id: str
    created_at: int

    async def response(self) -> ResponseObject:
        answer = await self.chat.response()
        choice = answer.choices[0]
        return self._response(self._status(choice.finish_reason), message_items(choice.message),
                              ResponseUsage.of(answer.usage))

    async def events(self) -> AsyncIterator[StreamEvent]:
        sequence = itertools.count()
        async for event in self._events():
            event.sequence_number = next(sequence)
            yield event

    async def _events(self) -> AsyncIterator[StreamEvent]:
        yield ResponseLifecycleEvent(type="response.created", response=self._response("in_progress"))
        yield ResponseLifecycleEvent(type="response.in_progress", response=self._response("in_progress"))
        output, finish_reason, usage = OutputStream(), None, None
        try:
            async with contextlib.aclosing(self.chat.chunks()) as chunks:
                async for chunk in chunks:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        for event in output.delta(choice.delta):
                            yield event
                        finish_reason = choice.finish_reason or finish_reason
        except (EngineStepError, EngineDeadError) as exc:
            # No item is done: the Response that failed holds them as they were.
            error = ResponseError(message=engine_error(exc).message)
            yield ResponseLifecycleEvent(type="response.failed",
                                         response=self._response("failed", output.items, error=error))
            return
        status = self._status(finish_reason)
        for event in output.finish(status):
            yield event
        response = self._response(status, output.items, ResponseUsage.of(usage) if usage else None)
        yield ResponseLifecycleEvent(type=f"response.{status}", response=response)

    @staticmethod
    def _status(finish_reason: str | None) -> ItemStatus:
        return "incomplete" if finish_reason == "length" else "completed"

    def _response(self, status: str, items: list[ItemBuilder] = (), usage: ResponseUsage | None = None,
                   error: ResponseError | None = None) -> ResponseObject:
        """The Response with ``status``; its items are done, the last one incomplete unless it completed."""
        last: ItemStatus = "completed" if status == "completed" else "incomplete"
        output = [item.item(last if index == len(items) - 1 else "completed") for index, item in enumerate(items)]
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(id=self.id, created_at=self.created_at, status=status, error=error,
                              incomplete_details=incomplete, model=self.chat.name, output=output, usage=usage,
                              **self.body.echoed())


def event_stream(events: AsyncIterator[StreamEvent]) -> StreamingResponse:
    """Responses' server-sent events: ``event: <type>`` and ``data: <the event>``, and no ``[DONE]``."""

    async def lines() -> AsyncIterator[str]:
        async for event in events:
            yield f"event: {event.type}\ndata: {event.model_dump_json(by_alias=True)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
