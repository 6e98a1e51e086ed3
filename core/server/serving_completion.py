"""``POST /v1/completions``: one engine request per prompt, answered whole or streamed."""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from hookllm.engine.async_llm import AsyncLLM
from hookllm.outputs import RequestOutput
from hookllm.server.errors import OpenAIError
from hookllm.server.logprobs import completion_logprobs, convert_logprobs
from hookllm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from hookllm.server.state import sampling_params, server_state
from hookllm.server.streaming import Result, gather, merge, sse, until_disconnect

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    name = state.model_name(body.model)
    if body.echo and body.logprobs is not None:
        raise OpenAIError(400, "echo with logprobs is not supported (no prompt logprobs)", param="echo")
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
        body.prompt[0], int) else [body.prompt]
    if not prompts:
        raise OpenAIError(400, "prompt is empty", param="prompt")
    params = sampling_params(body, body.max_tokens, body.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"

    async def run() -> Response:
        gens = await state.start(prompts, params, request_id)
        return (completion_stream(state.engine, body, name, request_id, gens) if body.stream
                else await completion_response(state.engine, body, name, request_id, gens))

    return await until_disconnect(request, run())


def echo_text(engine: AsyncLLM, result: Result | RequestOutput) -> str:
    return result.prompt if result.prompt is not None else engine.decode(result.prompt_token_ids)


async def completion_response(engine: AsyncLLM, body: CompletionRequest, name: str, request_id: str,
                              gens: list[AsyncIterator[RequestOutput]]) -> CompletionResponse:
    results = await gather(gens)
    choices = []
    for index, result in enumerate(results):
        prefix = echo_text(engine, result) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(
                convert_logprobs(engine, result.token_ids, result.logprobs, body.logprobs), len(prefix))
        choices.append(CompletionChoice(index=index, text=prefix + result.text, logprobs=logprobs,
                                        finish_reason=result.finish_reason))
    usage = UsageInfo.of(sum(len(r.prompt_token_ids) for r in results), sum(len(r.token_ids) for r in results))
    return CompletionResponse(id=request_id, model=name, choices=choices, usage=usage)


def completion_stream(engine: AsyncLLM, body: CompletionRequest, name: str, request_id: str,
                      gens: list[AsyncIterator[RequestOutput]]) -> StreamingResponse:
    async def chunks() -> AsyncIterator[CompletionResponse]:
        offsets = [0] * len(gens)  # text so far per choice, for logprobs' text_offset
        begun: set[int] = set()
        prompt_tokens = completion_tokens = 0
        async for index, output in merge(gens):
            completion = output.outputs[0]
            text = completion.text
            if index not in begun:  # a request's first output: count (and echo) its prompt
                begun.add(index)
                prompt_tokens += len(output.prompt_token_ids)
                if body.echo:
                    text = echo_text(engine, output) + text
            completion_tokens += len(completion.token_ids)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(convert_logprobs(
                    engine, completion.token_ids, completion.logprobs, body.logprobs), offsets[index])
            offsets[index] += len(text)
            yield CompletionResponse(id=request_id, model=name, choices=[CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason)])
        if body.stream_options and body.stream_options.include_usage:
            yield CompletionResponse(id=request_id, model=name, choices=[],
                                     usage=UsageInfo.of(prompt_tokens, completion_tokens))

    return sse(chunks())
