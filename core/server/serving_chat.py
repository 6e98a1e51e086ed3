"""``POST /v1/chat/completions``: the conversation through the model's chat template, answered
whole or streamed (a role chunk, then content deltas).

``start_chat`` is the endpoint's whole pipeline short of HTTP; ``/v1/responses`` runs on it too.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hookllm.outputs import RequestOutput
from hookllm.server.logprobs import chat_logprobs, convert_logprobs
from hookllm.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatResponseMessage, ChatStreamChoice, DeltaMessage, UsageInfo)
from hookllm.server.state import ServerState, sampling_params, server_state
from hookllm.server.streaming import gather, sse, until_disconnect

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
    its answer whole (``response``) or as stream chunks (``chunks``), one of the two."""

    state: ServerState
    body: ChatCompletionRequest
    name: str
    request_id: str
    gen: AsyncIterator[RequestOutput]
    num_top: int

    async def response(self) -> ChatCompletionResponse:
        (result,) = await gather([self.gen])
        logprobs = (chat_logprobs(convert_logprobs(self.state.engine, result.token_ids, result.logprobs,
                                                   self.num_top)) if self.body.logprobs else None)
        choice = ChatChoice(index=0, message=ChatResponseMessage(content=result.text), logprobs=logprobs,
                            finish_reason=result.finish_reason)
        return ChatCompletionResponse(id=self.request_id, model=self.name, choices=[choice],
                                      usage=UsageInfo.of(len(result.prompt_token_ids), len(result.token_ids)))

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        # The role comes alone first, then content deltas, as OpenAI streams them.
        yield self._chunk([ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
        prompt_tokens = completion_tokens = 0
        async with contextlib.aclosing(self.gen) as gen:
            async for output in gen:
                completion = output.outputs[0]
                prompt_tokens = prompt_tokens or len(output.prompt_token_ids)
                completion_tokens += len(completion.token_ids)
                logprobs = (chat_logprobs(convert_logprobs(self.state.engine, completion.token_ids,
                                                           completion.logprobs, self.num_top))
                            if self.body.logprobs else None)
                yield self._chunk([ChatStreamChoice(index=0, delta=DeltaMessage(content=completion.text),
                                                    logprobs=logprobs, finish_reason=completion.finish_reason)])
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield ChatCompletionChunk(id=self.request_id, model=self.name, choices=[],
                                      usage=UsageInfo.of(prompt_tokens, completion_tokens))

    def _chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.name, choices=choices)


async def start_chat(state: ServerState, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    """Validate ``body``, render its conversation and start it on the engine (OpenAIError: its HTTP error)."""
    name = state.model_name(body.model)
    num_top = body.top_logprobs or 0
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, num_top if body.logprobs else None)
    prompt = await state.render_chat(body, chat_template=body.chat_template,
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message, tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
    (gen,) = await state.start([prompt], params, request_id)
    return ChatRun(state, body, name, request_id, gen, num_top)
