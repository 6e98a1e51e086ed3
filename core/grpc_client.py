"""A Python client of the gRPC engine service (``hookllm serve --grpc-port``, or vLLM's own server):

    from hookllm.grpc_client import GrpcClient

    with GrpcClient("127.0.0.1:50051") as client:
        [done] = client.generate([1, 2, 3], max_tokens=16, temperature=0.0)
        print(done.output_ids, done.finish_reason)
        for response in client.stream("Hello", max_tokens=16):
            if response.HasField("chunk"):
                print(response.chunk.token_ids)

``AsyncGrpcClient`` has the same methods as coroutines (``stream`` an async iterator). A prompt is
a string (the server tokenizes it) or token ids; the keyword arguments are the proto's
``SamplingParams`` fields, plus a constraint by its field name (``json_schema``, ``regex``,
``grammar``, ``json_object``, ``choice`` as a list of strings). ``generate`` returns one
``GenerateComplete`` per choice; a failed call raises ``grpc.RpcError`` with the server's status.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterator

import grpc

from hookllm.grpc import vllm_engine_pb2 as pb2
from hookllm.grpc import vllm_engine_pb2_grpc as pb2_grpc


def generate_request(prompt: str | list[int], *, request_id: str = "", stream: bool = False,
                     **sampling: Any) -> pb2.GenerateRequest:
    """The ``GenerateRequest`` of ``prompt`` with the ``SamplingParams`` fields in ``sampling``."""
    if "choice" in sampling:
        sampling["choice"] = pb2.ChoiceConstraint(choices=sampling["choice"])
    params = pb2.SamplingParams(**sampling)
    if isinstance(prompt, str):
        return pb2.GenerateRequest(request_id=request_id, text=prompt, sampling_params=params, stream=stream)
    return pb2.GenerateRequest(request_id=request_id, tokenized=pb2.TokenizedInput(input_ids=prompt),
                               sampling_params=params, stream=stream)


class GrpcClient:
    """A blocking client over one channel to ``target`` (``host:port``); ``timeout``: each call's
    deadline in seconds (None: none)."""

    def __init__(self, target: str, timeout: float | None = None):
        self.target = target
        self.channel = grpc.insecure_channel(target)
        self.stub = pb2_grpc.VllmEngineStub(self.channel)
        self.timeout = timeout

    def generate(self, prompt: str | list[int], request_id: str = "", **sampling: Any) -> list[pb2.GenerateComplete]:
        request = generate_request(prompt, request_id=request_id, **sampling)
        return [r.complete for r in self.stub.Generate(request, timeout=self.timeout)]

    def stream(self, prompt: str | list[int], request_id: str = "", **sampling: Any) -> Iterator[pb2.GenerateResponse]:
        """The responses as they come: chunks, and each choice's complete message."""
        return self.stub.Generate(generate_request(prompt, request_id=request_id, stream=True, **sampling),
                                  timeout=self.timeout)

    def abort(self, request_ids: list[str]) -> None:
        self.stub.Abort(pb2.AbortRequest(request_ids=request_ids), timeout=self.timeout)

    def health_check(self) -> pb2.HealthCheckResponse:
        return self.stub.HealthCheck(pb2.HealthCheckRequest(), timeout=self.timeout)

    def model_info(self) -> pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=self.timeout)

    def server_info(self) -> pb2.GetServerInfoResponse:
        return self.stub.GetServerInfo(pb2.GetServerInfoRequest(), timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GrpcClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGrpcClient:
    """``GrpcClient`` on grpcio's asyncio channel (create it inside the event loop that uses it)."""

    def __init__(self, target: str, timeout: float | None = None):
        self.target = target
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb2_grpc.VllmEngineStub(self.channel)
        self.timeout = timeout

    async def generate(self, prompt: str | list[int], request_id: str = "",
                       **sampling: Any) -> list[pb2.GenerateComplete]:
        request = generate_request(prompt, request_id=request_id, **sampling)
        return [r.complete async for r in self.stub.Generate(request, timeout=self.timeout)]

    def stream(self, prompt: str | list[int], request_id: str = "",
               **sampling: Any) -> AsyncIterator[pb2.GenerateResponse]:
        """The responses as they come (cancel the call by breaking out of the loop)."""
        return self.stub.Generate(generate_request(prompt, request_id=request_id, stream=True, **sampling),
                                  timeout=self.timeout).__aiter__()

    async def abort(self, request_ids: list[str]) -> None:
        await self.stub.Abort(pb2.AbortRequest(request_ids=request_ids), timeout=self.timeout)

    async def health_check(self) -> pb2.HealthCheckResponse:
        return await self.stub.HealthCheck(pb2.HealthCheckRequest(), timeout=self.timeout)

    async def model_info(self) -> pb2.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=self.timeout)

    async def server_info(self) -> pb2.GetServerInfoResponse:
        return await self.stub.GetServerInfo(pb2.GetServerInfoRequest(), timeout=self.timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncGrpcClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
