"""``POST /v1/chat/completions``: the conversation through the model's chat template, answered
whole or streamed (a role chunk per choice, then deltas), each choice's reply parsed for
reasoning and tool calls (``hookllm.server.tool_calling``, ``hookllm.server.reply_parsing``).

``start_chat`` is the endpoint's whole pipeline short of HTTP; ``/v1/responses`` runs on it too.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hookllm.outputs import RequestOutput
from hookllm.server.logprobs import chat_logprobs, convert_logprobs
from hookllm.server.errors import OpenAIError
from hookllm.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatLogprobs, ChatStreamChoice, DeltaMessage, UsageInfo)
from hookllm.server.reply_parsing import ReplyParser
from hookllm.server.state import ServerState, server_state
from hookllm.server.streaming import gather, sse, until_disconnect
from hookllm.server.tool_calling import chat_tools

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)

    async def run() -> Response:
        chat = await start_chat(state, body, f"chatcmpl-{uuid.uuid4().hex}")
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
        # Each choice's role comes alone first, then its deltas, as OpenAI streams them.
        for index in range(self.body.n):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        parsers = [self.replies() for _ in range(self.body.n)]
        prompt_tokens = completion_tokens = 0
        async with contextlib.aclosing(self.gen) as gen:
            async for output in gen:
                prompt_tokens = prompt_tokens or len(output.prompt_token_ids)
                choices = []
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    parser = parsers[completion.index]
                    delta = parser.feed(completion.text, final=completion.finish_reason is not None)
                    logprobs = self._logprobs(completion.token_ids, completion.logprobs)
                    if delta != DeltaMessage() or logprobs is not None or completion.finish_reason is not None:
                        choices.append(ChatStreamChoice(
                            index=completion.index, delta=delta, logprobs=logprobs,
                            finish_reason=_finish_reason(completion.finish_reason, parser.called)))
                if choices:
                    yield self._chunk(choices)
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield ChatCompletionChunk(id=self.request_id, model=self.name, choices=[],
                                      usage=UsageInfo.of(prompt_tokens, completion_tokens))

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Any]] | None) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(convert_logprobs(self.state.engine, token_ids, logprobs, self.num_top))

    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.name, choices=choices)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that stopped after making tool calls finished with them, as OpenAI reports it."""
    return "tool_calls" if called and reason == "stop" else reason


async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    """Validate ``body``, render its conversation and start it on the engine (OpenAIError: its HTTP error)."""
    name = state.model_name(body.model)
    num_top = body.top_logprobs or 0
    params = state.sampling_params(body, body.max_completion_tokens or body.max_tokens,
                                   num_top if body.logprobs else None)
    tools = chat_tools(state, body)
    params = tools.constrain(params)
    prompt = await state.render_chat(body, chat_template=body.chat_template,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message, tools=tools.template_tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
    try:
        (gen,) = await state.start([prompt], params, request_id)
    except OpenAIError as exc:
        raise tools.explain(exc) from None
    return ChatRun(state, body, name, request_id, gen, num_top, tools.replies)
