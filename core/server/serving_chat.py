"""``POST /v1/chat/completions``: the conversation through the model's chat template, answered
whole or streamed (a role chunk, then content deltas)."""

from __future__ import annotations

import contextlib
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from hookllm.engine.async_llm import AsyncLLM
from hookllm.outputs import RequestOutput
from hookllm.server.logprobs import chat_logprobs, convert_logprobs
from hookllm.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatResponseMessage, ChatStreamChoice, DeltaMessage, UsageInfo)
from hookllm.server.state import sampling_params, server_state
from hookllm.server.streaming import gather, sse, until_disconnect

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    name = state.model_name(body.model)
    num_top = body.top_logprobs or 0
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, num_top if body.logprobs else None)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"

    async def run() -> Response:
        prompt = await state.render_chat(body, chat_template=body.chat_template,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message, tools=body.tools,
                                         chat_template_kwargs=body.chat_template_kwargs)
        gens = await state.start([prompt], params, request_id)
        if body.stream:
            return sse(chat_chunks(state.engine, body, name, request_id, gens[0], num_top))
        (result,) = await gather(gens)
        logprobs = (chat_logprobs(convert_logprobs(state.engine, result.token_ids, result.logprobs, num_top))
                    if body.logprobs else None)
        choice = ChatChoice(index=0, message=ChatResponseMessage(content=result.text), logprobs=logprobs,
                            finish_reason=result.finish_reason)
        return ChatCompletionResponse(id=request_id, model=name, choices=[choice],
                                      usage=UsageInfo.of(len(result.prompt_token_ids), len(result.token_ids)))

    return await until_disconnect(request, run())


async def chat_chunks(engine: AsyncLLM, body: ChatCompletionRequest, name: str, request_id: str,
                      gen: AsyncIterator[RequestOutput], num_top: int) -> AsyncIterator[ChatCompletionChunk]:
    # The role comes alone first, then content deltas, as OpenAI streams them.
    yield ChatCompletionChunk(id=request_id, model=name,
                              choices=[ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))])
    prompt_tokens = completion_tokens = 0
    async with contextlib.aclosing(gen):
        async for output in gen:
            completion = output.outputs[0]
            prompt_tokens = prompt_tokens or len(output.prompt_token_ids)
            completion_tokens += len(completion.token_ids)
            logprobs = (chat_logprobs(convert_logprobs(engine, completion.token_ids, completion.logprobs, num_top))
                        if body.logprobs else None)
            yield ChatCompletionChunk(id=request_id, model=name, choices=[ChatStreamChoice(
                index=0, delta=DeltaMessage(content=completion.text), logprobs=logprobs,
                finish_reason=completion.finish_reason)])
    if body.stream_options and body.stream_options.include_usage:
        yield ChatCompletionChunk(id=request_id, model=name, choices=[],
                                  usage=UsageInfo.of(prompt_tokens, completion_tokens))
