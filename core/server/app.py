"""The OpenAI-compatible FastAPI app over an ``AsyncLLM``.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): bad input is a
400 naming the field, a failed engine step a 500 for the requests it held. A client that
disconnects has its request aborted at once (streaming: Starlette cancels the response;
otherwise a watcher on the connection cancels the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import unquote, urlparse

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from hookllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from hookllm.outputs import RequestOutput
from hookllm.sampling_params import SamplingParams
from hookllm.server.metrics import RequestTimer, ServerMetrics
from hookllm.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                     ChatLogprobs, ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob,
                                     CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                     DeltaMessage, DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse,
                                     ModelCard, ModelList, TokenizeRequest, TokenizeResponse, TopLogprob, UsageInfo)

OPEN_PATHS = {"/health", "/version", "/metrics"}  # answered without the API key


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | int | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code if code else status))
    return JSONResponse(body.model_dump(), status_code=status)


def engine_error(exc: Exception) -> OpenAIError:
    """The engine's exceptions as HTTP errors: bad input 400, a failed step 500, shut down 503."""
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc))
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, str(exc), "internal_server_error")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), "service_unavailable")
    raise exc


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    allowed_local_media_path: Path | None = None


# --- logprobs ------------------------------------------------------------------------------------

@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


def convert_logprobs(engine: AsyncLLM, token_ids: list[int], entries: list[dict[int, Any]] | None,
                     num_top: int) -> list[TokenLogprob]:
    """The engine's per-token ``{token_id: Logprob}`` maps as (token text, logprob, top ``num_top``).

    The one place that reads the engine's logprob entries. Token texts are decoded one id at a time.
    """
    result = []
    for token_id, entry in zip(token_ids, entries or []):
        values = {tid: v.logprob for tid, v in entry.items()}
        top = sorted(values.items(), key=lambda item: item[1], reverse=True)[:num_top]
        result.append(TokenLogprob(engine.decode_token(token_id), values[token_id],
                                   [(engine.decode_token(tid), lp) for tid, lp in top]))
    return result


def completion_logprobs(tokens: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token in tokens:
        out.tokens.append(token.token)
        out.token_logprobs.append(token.logprob)
        out.top_logprobs.append(dict(token.top))
        out.text_offset.append(offset)
        offset += len(token.token)
    return out


def chat_logprobs(tokens: list[TokenLogprob]) -> ChatLogprobs:
    def utf8(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    return ChatLogprobs(content=[
        ChatTokenLogprob(token=t.token, logprob=t.logprob, bytes=utf8(t.token),
                         top_logprobs=[TopLogprob(token=s, logprob=lp, bytes=utf8(s)) for s, lp in t.top])
        for t in tokens])


# --- running requests ----------------------------------------------------------------------------

@dataclass
class Result:
    """One request's outputs gathered: what a non-streamed response reports."""

    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        if output.prompt_token_ids:
            self.prompt, self.prompt_token_ids = output.prompt, output.prompt_token_ids
        self.text += completion.text
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs or []
        self.finish_reason = completion.finish_reason


async def tracked(engine: AsyncLLM, metrics: ServerMetrics, prompt: Any, params: SamplingParams,
                  request_id: str) -> AsyncIterator[RequestOutput]:
    """``engine.generate`` with its metrics recorded (tokens, TTFT, TPOT, finish reason)."""
    timer: RequestTimer | None = None
    reason = "abort"
    try:
        async for output in engine.generate(prompt, params, request_id):
            if timer is None:
                timer = RequestTimer(metrics, len(output.prompt_token_ids))
            timer.tokens(len(output.outputs[0].token_ids))
            if output.finished:
                reason = output.outputs[0].finish_reason or "stop"
            yield output
    except EngineStepError:
        reason = "error"
        raise
    finally:
        if timer is not None or reason == "error":
            metrics.request_finished(reason)


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


class APIKeyMiddleware:
    """Pure ASGI (it leaves disconnect detection and streaming alone): every path but
    ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key (Authorization: Bearer ...)",
                                          "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# --- the app -------------------------------------------------------------------------------------

def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The app serving ``engine``; plugins' ``add_routes`` hooks add their routes last."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()  # uvicorn has drained (or timed out) the connections: stop the engine

    app = FastAPI(title="hookllm", version=metadata.version("hookllm"), lifespan=lifespan)
    app.state.engine = engine
    metrics = app.state.metrics = ServerMetrics(engine, settings.served_model_names[0])
    max_model_len = engine.model_config.max_model_len
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                                  "invalid_request_error")
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or None
        return error_response(400, f"{param or 'body'}: {first['msg']}", "invalid_request_error", param)

    def model_name(requested: str | None) -> str:
        if requested is None or requested in settings.served_model_names:
            return settings.served_model_names[0]
        raise OpenAIError(404, f"the model {requested!r} does not exist; served: "
                          f"{', '.join(settings.served_model_names)}", "NotFoundError", "model", "model_not_found")

    def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
        try:
            params = body.sampling_params(max_tokens, logprobs)
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0].rstrip(":")
            raise OpenAIError(400, str(exc), param=param if param in type(body).model_fields else None) from None
        if ((params.structured_outputs is not None or "structured_outputs" in params.extra_args)
                and "structured" not in engine.active_plugins):
            # Without the plugin nothing would enforce the format: refuse rather than ignore it.
            param = ("structured_outputs" if body.structured_outputs is not None
                     else "response_format" if body.response_format is not None else "extra_args")
            raise OpenAIError(400, f"{param} needs the structured output plugin: start the server with "
                              "--plugin structured", param=param)
        return params

    async def started(prompts: list[Any], params: SamplingParams, base_id: str) -> list[AsyncIterator[RequestOutput]]:
        gens = [tracked(engine, metrics, prompt, params, f"{base_id}-{i}") for i, prompt in enumerate(prompts)]
        try:
            return await start_streams(gens)
        except (ValueError, EngineStepError, EngineDeadError) as exc:
            raise engine_error(exc) from None

    def local_media(url: str) -> str:
        """An ``image_url`` as the image plugin reads it: data URLs as they are, ``file://`` URLs
        as a path, only inside ``--allowed-local-media-path``; nothing else is fetched."""
        if url.startswith("data:"):
            return url
        parsed = urlparse(url)
        if parsed.scheme != "file":
            raise OpenAIError(400, "image_url must be a base64 data: URL (or a file:// URL under the server's "
                              "--allowed-local-media-path)", param="messages")
        root = settings.allowed_local_media_path
        if root is None:
            raise OpenAIError(400, "file:// image URLs are refused: the server has no --allowed-local-media-path",
                              param="messages")
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(root):
            raise OpenAIError(400, f"file:// image URLs must point inside {root}", param="messages")
        return str(path)

    def conversation(body: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
        messages = [message.model_dump(exclude_none=True) for message in body.messages or []]
        for message in messages:
            for part in message.get("content") if isinstance(message.get("content"), list) else []:
                if part["type"] == "image_url":
                    part["image_url"]["url"] = local_media(part["image_url"]["url"])
        return messages

    async def render(body: ChatCompletionRequest | TokenizeRequest, **kwargs: Any) -> dict[str, Any]:
        try:
            return await engine.render_chat(conversation(body), **kwargs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": metadata.version("hookllm")}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.config.model, max_model_len=max_model_len)
                               for name in settings.served_model_names])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            tokens = (await render(body, add_generation_prompt=body.add_generation_prompt))["prompt_token_ids"]
        else:
            tokens = await engine.tokenize(body.prompt, body.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        model_name(body.model)
        try:
            return DetokenizeResponse(prompt=await engine.detokenize(body.tokens))
        except Exception as exc:  # noqa: BLE001 - the tokenizer's error for ids it does not know
            raise OpenAIError(400, f"cannot detokenize: {exc}", param="tokens") from None

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        name = model_name(body.model)
        if body.echo and body.logprobs is not None:
            raise OpenAIError(400, "echo with logprobs is not supported (no prompt logprobs)", param="echo")
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        if not prompts:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        params = sampling_params(body, body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"

        async def run() -> Response:
            gens = await started(prompts, params, request_id)
            return (completion_stream(body, name, request_id, gens) if body.stream
                    else await completion_response(body, name, request_id, gens))

        return await until_disconnect(request, run())

    def echo_text(result: Result | RequestOutput) -> str:
        return result.prompt if result.prompt is not None else engine.decode(result.prompt_token_ids)

    async def completion_response(body: CompletionRequest, name: str, request_id: str,
                                  gens: list[AsyncIterator[RequestOutput]]) -> CompletionResponse:
        results = [Result() for _ in gens]
        try:
            async for index, output in merge(gens):
                results[index].add(output)
        except (EngineStepError, EngineDeadError) as exc:
            raise engine_error(exc) from None
        choices = []
        for index, result in enumerate(results):
            prefix = echo_text(result) if body.echo else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(
                    convert_logprobs(engine, result.token_ids, result.logprobs, body.logprobs), len(prefix))
            choices.append(CompletionChoice(index=index, text=prefix + result.text, logprobs=logprobs,
                                            finish_reason=result.finish_reason))
        usage = UsageInfo.of(sum(len(r.prompt_token_ids) for r in results), sum(len(r.token_ids) for r in results))
        return CompletionResponse(id=request_id, model=name, choices=choices, usage=usage)

    def completion_stream(body: CompletionRequest, name: str, request_id: str,
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
                        text = echo_text(output) + text
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

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        name = model_name(body.model)
        num_top = body.top_logprobs or 0
        params = sampling_params(body, body.max_completion_tokens or body.max_tokens,
                                 num_top if body.logprobs else None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        async def run() -> Response:
            prompt = await render(body, chat_template=body.chat_template,
                                  add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message, tools=body.tools,
                                  chat_template_kwargs=body.chat_template_kwargs)
            (gen,) = await started([prompt], params, request_id)
            if body.stream:
                return sse(chat_chunks(body, name, request_id, gen, num_top))
            result = Result()
            try:
                async with contextlib.aclosing(gen):
                    async for output in gen:
                        result.add(output)
            except (EngineStepError, EngineDeadError) as exc:
                raise engine_error(exc) from None
            logprobs = (chat_logprobs(convert_logprobs(engine, result.token_ids, result.logprobs, num_top))
                        if body.logprobs else None)
            choice = ChatChoice(index=0, message=ChatResponseMessage(content=result.text), logprobs=logprobs,
                                finish_reason=result.finish_reason)
            return ChatCompletionResponse(id=request_id, model=name, choices=[choice],
                                          usage=UsageInfo.of(len(result.prompt_token_ids), len(result.token_ids)))

        return await until_disconnect(request, run())

    async def chat_chunks(body: ChatCompletionRequest, name: str, request_id: str,
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

    engine.hooks.hook.add_routes(app=app, engine=engine)
    return app
