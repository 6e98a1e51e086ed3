"""Running a response's requests on the engine: start them, merge their outputs, gather them or
stream them as server-sent events, and abort them when the client goes away.

A client that disconnects has its requests aborted at once: streaming, Starlette cancels the
response; otherwise ``until_disconnect`` cancels the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from hookllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from hookllm.lora.request import LoRARequest
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.sampling_params import SamplingParams
from hookllm.server.errors import engine_error
from hookllm.server.metrics import RequestTimer, ServerMetrics
from hookllm.server.protocol import ErrorInfo, ErrorResponse, StreamOptions, UsageInfo

logger = logging.getLogger(__name__)


async def tracked(engine: AsyncLLM, metrics: ServerMetrics, prompt: Any, params: SamplingParams,
                  request_id: str, arrival: float, log_requests: bool = False,
                  lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
    """``engine.generate`` (with ``lora_request``'s adapter, if any) with its metrics recorded
    (tokens; TTFT, TPOT and end-to-end latency from ``arrival``, the HTTP request's; finish
    reason); with ``log_requests``, its end logged (debug level: ``hookllm serve
    --enable-log-requests --log-level debug``)."""
    timer: RequestTimer | None = None
    reason = "abort"
    try:
        async for output in engine.generate(prompt, params, request_id, lora_request):
            if output.finished:
                reason = output.outputs[0].finish_reason or "stop"
            if timer is None:
                timer = RequestTimer(metrics, arrival, len(output.prompt_token_ids))
            # n > 1: several completions' tokens. An abort's output ends nothing a client waited for.
            timer.output(sum(len(completion.token_ids) for completion in output.outputs),
                         output.finished and reason != "abort")
            yield output
    except EngineStepError:
        reason = "error"
        raise
    finally:
        if timer is not None or reason == "error":
            metrics.request_finished(reason)
        if log_requests and timer is not None:
            logger.debug("request %s finished (%s): %d prompt tokens, %d output tokens, %.3f s, first token "
                         "after %s", request_id, reason, timer.num_prompt_tokens, timer.num_tokens, timer.latency,
                         "-" if timer.first_token_latency is None else f"{timer.first_token_latency:.3f} s")


async def start_streams(gens: list[AsyncIterator[RequestOutput]]) -> list[AsyncIterator[RequestOutput]]:
    """Wait for each request's first output, so bad input (or a failed first step) is still an
    HTTP status and not an error inside a 200 stream; on failure every request is aborted."""
    tasks = [asyncio.ensure_future(anext(gen)) for gen in gens]
    try:
        firsts = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()
        raise

    async def resumed(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for output in gen:
                yield output
        finally:
            await gen.aclose()

    return [resumed(first, gen) for first, gen in zip(firsts, gens)]


async def merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(gens) == 1:  # the usual case: no pump task and queue to pass through per output
        async with contextlib.aclosing(gens[0]) as gen:
            async for output in gen:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for output in gen:
                    queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Result:
    """One choice's outputs gathered: what a non-streamed response reports for it."""

    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Any] | None] | None = None  # when asked for
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    cumulative_logprob: float | None = None  # of the tokens so far, when logprobs were asked for
    finish_reason: str | None = None

    def add(self, output: RequestOutput, completion: CompletionOutput) -> None:
        if output.prompt_token_ids:
            self.prompt, self.prompt_token_ids = output.prompt, output.prompt_token_ids
            self.prompt_logprobs = output.prompt_logprobs
        self.text += completion.text
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs or []
        if completion.cumulative_logprob is not None:  # a delta carries the sum so far (an abort's, none)
            self.cumulative_logprob = completion.cumulative_logprob
        self.finish_reason = completion.finish_reason or self.finish_reason


async def gather(gens: list[AsyncIterator[RequestOutput]], n: int = 1) -> list[Result]:
    """Every choice's outputs, once all requests have finished: request ``i``'s completion ``j``
    (of its ``n``) is choice ``i * n + j``, as OpenAI numbers them. An engine failure is its HTTP error."""
    results = [Result() for _ in range(len(gens) * n)]
    try:
        async for index, output in merge(gens):
            for completion in output.outputs:
                results[index * n + completion.index].add(output, completion)
    except (EngineStepError, EngineDeadError) as exc:
        raise engine_error(exc) from None
    return results


@dataclass
class StreamUsage:
    """A stream's token counts so far, as ``stream_options`` asks for them: ``usage`` on every
    chunk with ``continuous_usage_stats``, a last chunk of it with ``include_usage``."""

    options: StreamOptions | None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def so_far(self) -> UsageInfo | None:
        """The usage a chunk carries (None: none)."""
        if self.options is None or not self.options.continuous_usage_stats:
            return None
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens)

    def final(self) -> UsageInfo | None:
        """The last chunk's usage (None: no such chunk)."""
        if self.options is None or not self.options.include_usage:
            return None
        return UsageInfo.of(self.prompt_tokens, self.completion_tokens)


async def until_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run ``handler``; if the client disconnects first, cancel it (which aborts its requests)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return task.result()


def sse(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events: ``data: {json}`` per chunk, an error event if the engine fails later, ``[DONE]``."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        except (EngineStepError, EngineDeadError) as exc:
            error = engine_error(exc)
            body = ErrorResponse(error=ErrorInfo(message=error.message, type=error.type, code=error.status))
            yield f"data: {body.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
