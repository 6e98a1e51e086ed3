"""``POST /v1/completions``: one engine request per prompt (with its ``n`` choices, or its
``best_of`` candidates of which the ``n`` best are returned), answered whole or streamed.

``echo`` with ``logprobs`` scores the prompt, as evaluation harnesses do: each choice's logprobs
begin with the prompt's tokens (the engine's prompt logprobs; the first token's is null), and
with ``max_tokens`` 0 that is the whole answer (one token is generated and left out, as vLLM does).
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from hookllm.engine.async_llm import AsyncLLM
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.server.errors import OpenAIError, generation_responses
from hookllm.server.logprobs import TokenLogprob, completion_logprobs, convert_logprobs
from hookllm.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from hookllm.server.state import server_state
from hookllm.server.streaming import Result, StreamUsage, gather, merge, sse, until_disconnect

router = APIRouter()


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(CompletionResponse, "a `CompletionResponse` per chunk, then `[DONE]`"))
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    model = await state.served_model(body.model)
    if body.max_tokens == 0 and not body.echo:
        raise OpenAIError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", param="max_tokens")
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
        body.prompt[0], int) else [body.prompt]
    if not prompts:
        raise OpenAIError(400, "prompt is empty", param="prompt")
    if not body.add_special_tokens:  # text prompts tokenized here, without the tokenizer's BOS
        prompts = [{"prompt": p, "prompt_token_ids": await state.engine.tokenize(p, add_special_tokens=False)}
                   if isinstance(p, str) else p for p in prompts]
    params = state.sampling_params(body, 1 if body.scores_only else body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"  # the engine requests' base: unique whatever the body says
    response_id = f"cmpl-{body.request_id}" if body.request_id is not None else request_id

    async def run() -> Response:
        gens = await state.start(prompts, params, request_id, model.lora_request)
        return (completion_stream(state.engine, body, model.name, response_id, gens) if body.stream
                else await completion_response(state.engine, body, model.name, response_id, gens, params.n))

    return await until_disconnect(request, run())


def echo_text(engine: AsyncLLM, result: Result | RequestOutput) -> str:
    return result.prompt if result.prompt is not None else engine.decode(result.prompt_token_ids)


async def completion_response(engine: AsyncLLM, body: CompletionRequest, name: str, request_id: str,
                              gens: list[AsyncIterator[RequestOutput]], candidates: int) -> CompletionResponse:
    """The whole answer: ``candidates`` completions per prompt (``best_of``, else ``n``), of which
    the ``n`` best are the choices. ``usage`` counts each prompt once and every candidate's tokens."""
    results = await gather(gens, candidates)
    usage = UsageInfo.of(sum(len(r.prompt_token_ids) for r in results[::candidates]),
                         0 if body.scores_only else sum(len(r.token_ids) for r in results))
    choices = [choice(engine, body, index, result, result, True, 0)
               for index, result in enumerate(best(results, candidates, body.n))]
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
        offsets: dict[int, int] = {}  # per choice begun, its tokens' text so far (logprobs' text_offset)
        begun: set[int] = set()  # the prompts whose tokens are counted
        usage = StreamUsage(body.stream_options)
        async for prompt_index, output in merge(gens):
            if prompt_index not in begun:
                begun.add(prompt_index)
                usage.prompt_tokens += len(output.prompt_token_ids)
            choices = []
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                if body.scores_only and index in offsets and completion.finish_reason is None:
                    continue  # the generated token, which is not part of the answer
                choices.append(choice(engine, body, index, output, completion, index not in offsets,
                                      offsets.get(index, 0)))
                offsets[index] = offsets.get(index, 0) + sum(map(len, choices[-1].logprobs.tokens
                                                                  if choices[-1].logprobs else []))
                usage.completion_tokens += 0 if body.scores_only else len(completion.token_ids)
            if choices:
                yield CompletionResponse(id=request_id, model=name, choices=choices, usage=usage.so_far())
        if usage.final() is not None:
            yield CompletionResponse(id=request_id, model=name, choices=[], usage=usage.final())

    return sse(chunks())


def choice(engine: AsyncLLM, body: CompletionRequest, index: int, prompt: Result | RequestOutput,
           completion: Result | CompletionOutput, first: bool, offset: int) -> CompletionChoice:
    """Choice ``index``'s text (the whole, or a stream's new part): on its ``first`` part, after
    its prompt when echoed, and only that when ``body.scores_only``. ``offset``: the text of its
    tokens before this part (logprobs' ``text_offset`` counts each token's text, as vLLM's does)."""
    echo = body.echo and first
    text = echo_text(engine, prompt) if echo else ""
    tokens: list[TokenLogprob] = []
    if echo and body.logprobs is not None:
        tokens += convert_logprobs(engine, prompt.prompt_token_ids, prompt.prompt_logprobs, body.logprobs)
    if not body.scores_only:
        text += completion.text
        if body.logprobs is not None:
            tokens += convert_logprobs(engine, completion.token_ids, completion.logprobs, body.logprobs)
    logprobs = completion_logprobs(tokens, offset) if body.logprobs is not None else None
    return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=completion.finish_reason)
