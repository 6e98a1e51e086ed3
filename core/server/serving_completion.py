"""``POST /v1/completions``: one engine request per prompt (with its ``n`` choices, or its
``best_of`` candidates of which the ``n`` best are returned), answered whole or streamed."""

from __future__ import annotations

import math
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from hookllm.engine.async_llm import AsyncLLM
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.server.errors import OpenAIError
from hookllm.server.logprobs import completion_logprobs, convert_logprobs
from hookllm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from hookllm.server.state import server_state
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
    params = state.sampling_params(body, body.max_tokens, body.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"

    async def run() -> Response:
        gens = await state.start(prompts, params, request_id)
        return (completion_stream(state.engine, body, name, request_id, gens) if body.stream
                else await completion_response(state.engine, body, name, request_id, gens, params.n))

    return await until_disconnect(request, run())


def echo_text(engine: AsyncLLM, result: Result | RequestOutput) -> str:
    return result.prompt if result.prompt is not None else engine.decode(result.prompt_token_ids)


async def completion_response(engine: AsyncLLM, body: CompletionRequest, name: str, request_id: str,
                              gens: list[AsyncIterator[RequestOutput]], candidates: int) -> CompletionResponse:
    """The whole answer: ``candidates`` completions per prompt (``best_of``, else ``n``), of which
    the ``n`` best are the choices. ``usage`` counts each prompt once and every candidate's tokens."""
    results = await gather(gens, candidates)
    usage = UsageInfo.of(sum(len(r.prompt_token_ids) for r in results[::candidates]),
                         sum(len(r.token_ids) for r in results))
    choices = []
    for index, result in enumerate(best(results, candidates, body.n)):
        prefix = echo_text(engine, result) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(
                convert_logprobs(engine, result.token_ids, result.logprobs, body.logprobs), len(prefix))
        choices.append(CompletionChoice(index=index, text=prefix + result.text, logprobs=logprobs,
                                        finish_reason=result.finish_reason))
    return CompletionResponse(id=request_id, model=name, choices=choices, usage=usage)


def best(results: list[Result], candidates: int, n: int) -> list[Result]:
    """Each prompt's ``n`` results of the highest cumulative logprob among its ``candidates``, best
    first (vLLM v0's ``best_of``); all of them, in order, when there are only ``n``."""
    if candidates == n:
        return results

    def score(result: Result) -> float:  # a candidate aborted before its first token ranks last
        return -math.inf if result.cumulative_logprob is None else result.cumulative_logprob

    groups = [results[start:start + candidates] for start in range(0, len(results), candidates)]
    return [result for group in groups for result in sorted(group, key=score, reverse=True)[:n]]


def completion_stream(engine: AsyncLLM, body: CompletionRequest, name: str, request_id: str,
                      gens: list[AsyncIterator[RequestOutput]]) -> StreamingResponse:
    """Server-sent chunks, each with the choices an engine output moved on: prompt ``i``'s
    completion ``j`` is choice ``i * n + j``. The usage chunk counts each prompt once."""

    async def chunks() -> AsyncIterator[CompletionResponse]:
        offsets: dict[int, int] = {}  # text so far per choice, for logprobs' text_offset
        begun: set[int] = set()  # the prompts whose tokens are counted
        prompt_tokens = completion_tokens = 0
        async for prompt_index, output in merge(gens):
            if prompt_index not in begun:
                begun.add(prompt_index)
                prompt_tokens += len(output.prompt_token_ids)
            choices = []
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                echo = echo_text(engine, output) if body.echo and index not in offsets else ""
                choices.append(stream_choice(engine, body, index, completion, echo, offsets.get(index, 0)))
                offsets[index] = offsets.get(index, 0) + len(choices[-1].text)
                completion_tokens += len(completion.token_ids)
            yield CompletionResponse(id=request_id, model=name, choices=choices)
        if body.stream_options and body.stream_options.include_usage:
            yield CompletionResponse(id=request_id, model=name, choices=[],
                                     usage=UsageInfo.of(prompt_tokens, completion_tokens))

    return sse(chunks())


def stream_choice(engine: AsyncLLM, body: CompletionRequest, index: int, completion: CompletionOutput,
                  echo: str, offset: int) -> CompletionChoice:
    """One choice's new text (after ``echo``, its prompt on its first chunk); ``offset``: its text so far."""
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(convert_logprobs(
            engine, completion.token_ids, completion.logprobs, body.logprobs), offset + len(echo))
    return CompletionChoice(index=index, text=echo + completion.text, logprobs=logprobs,
                            finish_reason=completion.finish_reason)
