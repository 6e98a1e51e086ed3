"""The gRPC front end: vLLM's engine service (``vllm.grpc.engine.VllmEngine``), the standard health
service and server reflection, on grpcio's asyncio server, over the same ``AsyncLLM`` (and the
same metrics) as the HTTP server.

Every request is parsed here from its bytes, so that a malformed message, or one carrying a field
number the proto does not define, is an ``INVALID_ARGUMENT`` naming it rather than grpcio's
generic error; each sampling field is honoured or refused, never ignored (docs/serving.md, "gRPC",
lists which). Bad input is refused before anything reaches the engine. A call that is cancelled or
whose deadline expires aborts its request in the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from hookllm.config import text_config_of
from hookllm.engine.async_llm import EngineDeadError, EngineStepError
from hookllm.grpc import vllm_engine_pb2 as pb2
from hookllm.outputs import CompletionOutput, RequestOutput
from hookllm.pooling_params import PoolingParams
from hookllm.sampling_params import SamplingParams, StructuredOutputsParams
from hookllm.server.state import ServerState
from hookllm.server.streaming import tracked

logger = logging.getLogger(__name__)
SERVICE = pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "vllm-grpc"  # what vLLM's server reports: callers may check it
StatusCode = grpc.StatusCode


@dataclass
class GrpcSettings:
    host: str
    port: int
    max_concurrent_rpcs: int = 1024  # calls past it get RESOURCE_EXHAUSTED at once
    max_message_bytes: int = 4 * 1024 * 1024  # either way; a larger message gets RESOURCE_EXHAUSTED
    shutdown_timeout: float = 10.0  # what in-flight calls get to finish once the server stops


class GrpcError(Exception):
    """A call's failure: its status code and a message naming the field at fault."""

    def __init__(self, code: StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def parse(message_cls: type[Message], data: bytes) -> Message:
    """``data`` as a ``message_cls``; ``GrpcError(INVALID_ARGUMENT)`` if it is no such message or
    sets a field number the proto does not define (at any depth)."""
    message = message_cls()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise GrpcError(StatusCode.INVALID_ARGUMENT, f"malformed {message_cls.__name__}: {exc}") from None
    _check_known_fields(message, message_cls.__name__)
    return message


def _check_known_fields(message: Message, path: str) -> None:
    unknown = UnknownFieldSet(message)
    if len(unknown):
        raise GrpcError(StatusCode.INVALID_ARGUMENT, f"{path} sets field number {unknown[0].field_number}, which "
                        "vllm_engine.proto does not define")
    for field, value in message.ListFields():
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for item in value if field.is_repeated else [value]:
                _check_known_fields(item, f"{path}.{field.name}")


def sampling_params(proto: pb2.SamplingParams, max_model_len: int) -> SamplingParams:
    """The request's ``SamplingParams``, as vLLM's server reads the proto (proto3's zero for
    "unset" where a zero would mean nothing: top_p, repetition_penalty, n);
    ``GrpcError(INVALID_ARGUMENT)`` naming the field for what hookllm refuses."""
    for name in ("logprobs", "prompt_logprobs"):
        if proto.HasField(name):
            raise _invalid(f"sampling_params.{name}: vllm_engine.proto's responses have no field to carry logprobs")
    if proto.spaces_between_special_tokens:
        raise _invalid("sampling_params.spaces_between_special_tokens: true is not supported (hookllm's "
                       "detokenizer, used for stop strings, never adds spaces between special tokens)")
    truncate = proto.truncate_prompt_tokens if proto.HasField("truncate_prompt_tokens") else None
    if truncate is not None and truncate == -1:
        truncate = max_model_len  # vLLM's -1: the model's context
    stop = list(proto.stop) or None
    try:
        return SamplingParams(
            temperature=proto.temperature if proto.HasField("temperature") else 1.0,
            top_p=proto.top_p or 1.0, top_k=proto.top_k, min_p=proto.min_p,
            frequency_penalty=proto.frequency_penalty, presence_penalty=proto.presence_penalty,
            repetition_penalty=proto.repetition_penalty or 1.0,
            max_tokens=proto.max_tokens if proto.HasField("max_tokens") else None, min_tokens=proto.min_tokens,
            stop=stop, stop_token_ids=list(proto.stop_token_ids) or None,
            skip_special_tokens=proto.skip_special_tokens, ignore_eos=proto.ignore_eos, n=proto.n or 1,
            seed=proto.seed if proto.HasField("seed") else None,
            include_stop_str_in_output=proto.include_stop_str_in_output,
            logit_bias=dict(proto.logit_bias) or None, truncate_prompt_tokens=truncate,
            structured_outputs=_constraint(proto),
            detokenize=stop is not None,  # tokens go out: text is made only to find stop strings
        )
    except ValueError as exc:
        raise _invalid(f"sampling_params: {exc}") from None


def _constraint(proto: pb2.SamplingParams) -> StructuredOutputsParams | None:
    kind = proto.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "structural_tag":
        raise _invalid("sampling_params.structural_tag: structural tags are not supported")
    if kind == "json_object" and not proto.json_object:
        raise _invalid("sampling_params.json_object: false asks for no constraint; leave the constraint unset")
    if kind == "choice":
        return StructuredOutputsParams(choice=list(proto.choice.choices))
    return StructuredOutputsParams(**{{"json_schema": "json"}.get(kind, kind): getattr(proto, kind)})


def _invalid(message: str) -> GrpcError:
    return GrpcError(StatusCode.INVALID_ARGUMENT, message)


def engine_status(exc: ValueError | EngineStepError | EngineDeadError) -> GrpcError:
    """The engine's exceptions as statuses: bad input, a failed step, an engine shut down."""
    if isinstance(exc, ValueError):
        return _invalid(str(exc))
    return GrpcError(StatusCode.INTERNAL if isinstance(exc, EngineStepError) else StatusCode.UNAVAILABLE, str(exc))


class VllmEngineService:
    """The ``VllmEngine`` methods over one ``ServerState``'s engine and metrics."""

    def __init__(self, state: ServerState):
        self.state = state
        self.engine = state.engine
        self.vocab_size = text_config_of(self.engine.model_config.hf_config).vocab_size
        self.started = time.time()
        self.last_receive = self.started

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; requests arrive as bytes (see :func:`parse`)."""
        unary = {"Embed": (pb2.EmbedRequest, self.embed), "HealthCheck": (pb2.HealthCheckRequest, self.health_check),
                 "Abort": (pb2.AbortRequest, self.abort), "GetModelInfo": (pb2.GetModelInfoRequest, self.model_info),
                 "GetServerInfo": (pb2.GetServerInfoRequest, self.server_info)}
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._unary(name, cls, method),
                                                              response_serializer=_serialize)
                    for name, (cls, method) in unary.items()}
        handlers["Generate"] = grpc.unary_stream_rpc_method_handler(self._generate, response_serializer=_serialize)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _unary(self, name: str, message_cls: type[Message],
               method: Callable[[Any], Awaitable[Message]]) -> Callable[[bytes, Any], Awaitable[Message]]:
        async def call(data: bytes, context: grpc.aio.ServicerContext) -> Message:
            with self._counted(name, context) as fail:
                try:
                    return await method(parse(message_cls, data))
                except GrpcError as exc:
                    await fail(exc)

        return call

    @contextlib.contextmanager
    def _counted(self, method: str, context: grpc.aio.ServicerContext) -> Any:
        """Counts the call by its outcome (``hookllm:grpc_requests_total``); yields how to fail it."""
        self.last_receive = time.time()
        outcome = ["OK"]

        async def fail(exc: GrpcError) -> None:
            outcome[0] = exc.code.name
            await context.abort(exc.code, exc.message)

        try:
            yield fail
        except asyncio.CancelledError:
            expired = context.time_remaining() is not None and context.time_remaining() <= 0
            outcome[0] = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        except Exception:
            if outcome[0] == "OK":
                outcome[0] = "INTERNAL"
            raise
        finally:
            self.state.metrics.grpc_request(method, outcome[0])

    async def _generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb2.GenerateResponse]:
        with self._counted("Generate", context) as fail:
            try:
                request = parse(pb2.GenerateRequest, data)
                async for response in self.generate(request):
                    yield response
            except GrpcError as exc:
                await fail(exc)

    async def generate(self, request: pb2.GenerateRequest) -> AsyncIterator[pb2.GenerateResponse]:
        """One chunk per engine output that made tokens (``stream``), and one complete message per
        choice as it finishes; without ``stream`` the complete messages alone, in choice order."""
        arrival = time.perf_counter()
        params = sampling_params(request.sampling_params, self.state.max_model_len)
        prompt = await self._prompt(request, params)
        request_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        choices = [_Choice() for _ in range(params.n)]
        outputs = tracked(self.engine, self.state.metrics, prompt, params, request_id, arrival,
                          self.state.settings.log_requests)
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    for completion in output.outputs:
                        choice = choices[completion.index]
                        choice.add(output, completion)
                        if request.stream and completion.token_ids:
                            yield pb2.GenerateResponse(chunk=choice.chunk(completion.token_ids))
                    if output.finished:  # an abort's output names choice 0 only: it ends them all
                        for choice in choices:
                            choice.finish_reason = choice.finish_reason or "abort"
                    for choice in choices if request.stream else ():
                        if choice.finish_reason and not choice.reported:
                            yield pb2.GenerateResponse(complete=choice.complete())
            for choice in choices if not request.stream else ():
                yield pb2.GenerateResponse(complete=choice.complete())
        except (ValueError, EngineStepError, EngineDeadError) as exc:
            raise engine_status(exc) from None

    def _check_token_ids(self, token_ids: list[int], field: str, empty: str) -> None:
        """An input's ids are not empty (else INVALID_ARGUMENT ``empty``) and are below the
        vocabulary size (INVALID_ARGUMENT naming ``field``)."""
        if not token_ids:
            raise _invalid(empty)
        too_large = next((i for i, token in enumerate(token_ids) if token >= self.vocab_size), None)
        if too_large is not None:
            raise _invalid(f"{field}.input_ids[{too_large}] = {token_ids[too_large]} is not below "
                           f"the vocabulary size {self.vocab_size}")

    async def _prompt(self, request: pb2.GenerateRequest, params: SamplingParams) -> dict[str, Any]:
        """The request's prompt as token ids (a text prompt tokenized here), checked against the
        vocabulary and the context before it reaches the engine."""
        kind = request.WhichOneof("input")
        if kind is None:
            raise _invalid("GenerateRequest.input: set tokenized (token ids) or text")
        if kind == "text":
            text, token_ids = request.text, await self.engine.tokenize(request.text) if request.text else []
        else:
            text, token_ids = request.tokenized.original_text or None, list(request.tokenized.input_ids)
        self._check_token_ids(token_ids, "GenerateRequest.tokenized", f"GenerateRequest.{kind}: the prompt is empty")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
            text = None
        limit = self.state.max_model_len
        if len(token_ids) >= limit:
            raise GrpcError(StatusCode.RESOURCE_EXHAUSTED, f"the prompt has {len(token_ids)} tokens; this model's "
                            f"context is {limit}, leaving no room for an output token")
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > limit:
            raise GrpcError(StatusCode.RESOURCE_EXHAUSTED, f"the prompt's {len(token_ids)} tokens and "
                            f"sampling_params.max_tokens {params.max_tokens} exceed this model's context of {limit}")
        return {"prompt_token_ids": token_ids, **({"prompt": text} if text else {})}

    async def embed(self, request: pb2.EmbedRequest) -> pb2.EmbedResponse:
        """The input's embedding, on a model served by the pooling runner (docs/pooling.md)."""
        if self.engine.model_config.runner != "pooling":
            raise GrpcError(StatusCode.UNIMPLEMENTED, "Embed: this server runs a generative model, not an embedding "
                            "model (hookllm serve --runner pooling)")
        token_ids = list(request.tokenized.input_ids)
        self._check_token_ids(token_ids, "EmbedRequest.tokenized", "EmbedRequest.tokenized: the input is empty")
        if len(token_ids) > self.state.max_model_len:
            raise GrpcError(StatusCode.RESOURCE_EXHAUSTED, f"the input has {len(token_ids)} tokens; this model's "
                            f"context is {self.state.max_model_len}")
        try:
            output = await self.engine.encode({"prompt_token_ids": token_ids}, PoolingParams(task="embed"),
                                              request.request_id or f"grpc-{uuid.uuid4().hex}")
        except (ValueError, EngineStepError, EngineDeadError) as exc:
            raise engine_status(exc) from None
        embedding = output.outputs.data
        return pb2.EmbedResponse(embedding=embedding.tolist(), prompt_tokens=len(token_ids),
                                 embedding_dim=embedding.shape[0])

    async def health_check(self, request: pb2.HealthCheckRequest) -> pb2.HealthCheckResponse:
        healthy = self.engine.is_running
        return pb2.HealthCheckResponse(healthy=healthy, message="healthy" if healthy else "the engine has stopped")

    async def abort(self, request: pb2.AbortRequest) -> pb2.AbortResponse:
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        return pb2.AbortResponse()

    async def model_info(self, request: pb2.GetModelInfoRequest) -> pb2.GetModelInfoResponse:
        hf_config = self.engine.model_config.hf_config
        return pb2.GetModelInfoResponse(
            model_path=self.engine.config.model, is_generation=True, max_context_length=self.state.max_model_len,
            vocab_size=self.vocab_size, supports_vision=getattr(hf_config, "vision_config", None) is not None)

    async def server_info(self, request: pb2.GetServerInfoRequest) -> pb2.GetServerInfoResponse:
        stats = self.engine.get_stats()
        return pb2.GetServerInfoResponse(
            active_requests=stats.num_running_reqs + stats.num_waiting_reqs + stats.num_swapped_reqs,
            is_paused=False, last_receive_timestamp=self.last_receive, uptime_seconds=time.time() - self.started,
            server_type=SERVER_TYPE)


class _Choice:
    """One choice's tokens so far, and the counts its messages carry."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.prompt_tokens = self.cached_tokens = 0
        self.finish_reason = ""
        self.reported = False  # its complete message went out

    def add(self, output: RequestOutput, completion: CompletionOutput) -> None:
        if output.prompt_token_ids:
            self.prompt_tokens, self.cached_tokens = len(output.prompt_token_ids), output.num_cached_tokens
        self.token_ids += completion.token_ids
        self.finish_reason = completion.finish_reason or self.finish_reason

    def chunk(self, new_token_ids: list[int]) -> pb2.GenerateStreamChunk:
        return pb2.GenerateStreamChunk(token_ids=new_token_ids, prompt_tokens=self.prompt_tokens,
                                       completion_tokens=len(self.token_ids), cached_tokens=self.cached_tokens)

    def complete(self) -> pb2.GenerateComplete:
        self.reported = True
        return pb2.GenerateComplete(output_ids=self.token_ids, finish_reason=self.finish_reason,
                                    prompt_tokens=self.prompt_tokens, completion_tokens=len(self.token_ids),
                                    cached_tokens=self.cached_tokens)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class GrpcFrontEnd:
    """The gRPC server of one API process: ``start()`` binds and serves; ``stop()`` (idempotent)
    refuses new calls, gives the ones in flight ``shutdown_timeout`` seconds, then cancels them."""

    def __init__(self, state: ServerState, settings: GrpcSettings):
        self.settings = settings
        self.service = VllmEngineService(state)
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self._stopping: asyncio.Future | None = None

    async def start(self) -> None:
        size = self.settings.max_message_bytes
        # grpcio binds with SO_REUSEPORT on Linux: each API server process binds the same port.
        self.server = grpc.aio.server(maximum_concurrent_rpcs=self.settings.max_concurrent_rpcs, options=[
            ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)])
        self.server.add_generic_rpc_handlers([self.service.handler()])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        host = self.settings.host
        address = f"[{host}]:{self.settings.port}" if ":" in host else f"{host}:{self.settings.port}"
        if self.server.add_insecure_port(address) == 0:
            raise RuntimeError(f"cannot listen for gRPC on {address}")
        await self.server.start()
        logger.info("serving gRPC on %s", address)
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> asyncio.Future:
        """Begin stopping (once); the future is done once the server has stopped."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        return self._stopping

    async def _stop(self) -> None:
        if self.server is None:
            return
        await self.health.enter_graceful_shutdown()  # health checks say NOT_SERVING from now
        await self.server.stop(self.settings.shutdown_timeout)
