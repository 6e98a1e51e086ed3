"""``POST /v1/chat/completions``: the conversation through the model's chat template, answered
whole or streamed (a role chunk per choice, then deltas), each choice's reply parsed for
reasoning and tool calls (``hookllm.server.tool_calling``, ``hookllm.server.reply_parsing``).

``start_chat`` is the endpoint's whole pipeline short of HTTP; ``/v1/responses`` runs on it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hookllm.outputs import RequestOutput
from hookllm.server.logprobs import chat_logprobs, convert_logprobs
from hookllm.server.errors import OpenAIError, generation_responses
from hookllm.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatLogprobs, ChatStreamChoice, DeltaMessage, UsageInfo)
from hookllm.server.reply_parsing import ReasoningOptions, ReplyParser
from hookllm.server.state import ServerState, server_state
from hookllm.server.streaming import StreamUsage, gather, sse, until_disconnect
from hookllm.server.tool_calling import chat_tools

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None, responses=generation_responses(
    ChatCompletionResponse, "a `ChatCompletionChunk` per chunk, then `[DONE]`"))
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)

    async def run() -> Response:
        chat = await start_chat(state, body, f"chatcmpl-{uuid.uuid4().hex}")
        if body.request_id is not None:  # the reply's id; the engine's stay unique
            chat = dataclasses.replace(chat, request_id=f"chatcmpl-{body.request_id}")
        return sse(chat.chunks()) if body.stream else await chat.response()

    return await until_disconnect(request, run())


@dataclass
class ChatRun:
    """A started chat request (past its first output, so bad input was already an HTTP error):
    its answer whole (``response``) or as stream chunks (``chunks``), one of the two. Each of
    its ``body.n`` choices is parsed on its own (``replies`` makes a parser per choice)."""

    state: ServerState
    body: ChatCompletionRequest
    name: str
    request_id: str
    gen: AsyncIterator[RequestOutput]
    num_top: int
    replies: Callable[[], ReplyParser]

    async def response(self) -> ChatCompletionResponse:
        results = await gather([self.gen], self.body.n)
        choices = []
        for index, result in enumerate(results):
            message = self.replies().parse(result.text)
            choices.append(ChatChoice(index=index, message=message,
                                      logprobs=self._logprobs(result.token_ids, result.logprobs),
                                      finish_reason=_finish_reason(result.finish_reason, bool(message.tool_calls))))
        usage = UsageInfo.of(len(results[0].prompt_token_ids), sum(len(result.token_ids) for result in results))
        return ChatCompletionResponse(id=self.request_id, model=self.name, choices=choices, usage=usage)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        parsers = [self.replies() for _ in range(self.body.n)]
        usage = StreamUsage(self.body.stream_options)
        async with contextlib.aclosing(self.gen) as gen:
            async for output in gen:
                if not usage.prompt_tokens:  # the first output (there already): the prompt's size is known
                    usage.prompt_tokens = len(output.prompt_token_ids)
                    # Each choice's role comes alone first, then its deltas, as OpenAI streams them.
                    for index in range(self.body.n):
                        yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                                            content=""))], usage)
                choices = []
                for completion in output.outputs:
                    usage.completion_tokens += len(completion.token_ids)
                    parser = parsers[completion.index]
                    delta = parser.feed(completion.text, final=completion.finish_reason is not None)
                    logprobs = self._logprobs(completion.token_ids, completion.logprobs)
                    if delta != DeltaMessage() or logprobs is not None or completion.finish_reason is not None:
                        choices.append(ChatStreamChoice(
                            index=completion.index, delta=delta, logprobs=logprobs,
                            finish_reason=_finish_reason(completion.finish_reason, parser.called)))
                if choices:
                    yield self._chunk(choices, usage)
        if usage.final() is not None:
            yield ChatCompletionChunk(id=self.request_id, model=self.name, choices=[], usage=usage.final())

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Any]] | None) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(convert_logprobs(self.state.engine, token_ids, logprobs, self.num_top))

    def _chunk(self, choices: list[ChatStreamChoice], usage: StreamUsage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.name, choices=choices, usage=usage.so_far())


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that stopped after making tool calls finished with them, as OpenAI reports it."""
    return "tool_calls" if called and reason == "stop" else reason


async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    """Validate ``body``, render its conversation and start it on the engine (OpenAIError: its HTTP error)."""
    model = await state.served_model(body.model)
    num_top = body.top_logprobs or 0
    params = state.sampling_params(body, body.max_completion_tokens or body.max_tokens,
                                   num_top if body.logprobs else None)
    tools = chat_tools(state, body)
    params = tools.constrain(params)
    template_variables = {name: value for name, value in (("documents", body.documents),
                                                         ("reasoning_effort", body.reasoning_effort))
                          if value is not None}
    prompt = await state.render_chat(body, chat_template=body.chat_template,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message, tools=tools.template_tools,
                                     chat_template_kwargs={**template_variables, **(body.chat_template_kwargs or {})})
    if body.add_special_tokens:
        prompt["prompt_token_ids"] = await state.engine.tokenize(prompt["prompt"])
    try:
        (gen,) = await state.start([prompt], params, request_id, model.lora_request)
    except OpenAIError as exc:
        raise tools.explain(exc) from None
    options = ReasoningOptions(separate=body.separate_reasoning, include=body.include_reasoning,
                               stream=body.stream_reasoning)
    return ChatRun(state, body, model.name, request_id, gen, num_top, lambda: tools.replies().with_options(options))
