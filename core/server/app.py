"""The OpenAI-compatible FastAPI app over an ``AsyncLLM``: the routes of ``serving_*`` over one
``ServerState`` (``serving_lora``'s only when runtime LoRA updating is allowed), the error
handlers, the API key check, and the plugins' routes."""

from __future__ import annotations

import contextlib
import hmac
from importlib import metadata
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from hookllm.engine.async_llm import AsyncLLM
from hookllm.server import (serving_basic, serving_chat, serving_completion, serving_lora, serving_pooling,
                            serving_responses)
from hookllm.server.errors import ERROR_DESCRIPTIONS, add_error_handlers, error_response
from hookllm.server.metrics import ArrivalTimeMiddleware
from hookllm.server.state import ServerSettings, ServerState

if TYPE_CHECKING:
    from hookllm.server.grpc_server import GrpcFrontEnd

OPEN_PATHS = {"/health", "/version", "/metrics"}  # answered without the API key


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
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, settings: ServerSettings,
              grpc_front: Callable[[ServerState], GrpcFrontEnd] | None = None) -> FastAPI:
    """The app serving ``engine``; plugins' ``add_routes`` hooks add their routes last. With
    ``grpc_front``, the gRPC server it makes of the app's state runs as long as the app does.
    ``ValueError`` for a ``settings.lora_modules`` adapter that does not fit the model."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if front is not None:
            await front.start()
        yield
        if front is not None:
            await front.stop()  # begun as the server began to stop (hookllm serve), else now
        engine.shutdown()  # uvicorn has drained (or timed out) the connections: stop the engine

    app = FastAPI(title="hookllm", version=metadata.version("hookllm"), lifespan=lifespan)
    app.state.server = ServerState.create(engine, settings)
    front = app.state.grpc = grpc_front(app.state.server) if grpc_front is not None else None
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(ArrivalTimeMiddleware)  # added last: the outermost layer, first to see a request
    add_error_handlers(app)
    for module in (serving_basic, serving_completion, serving_chat, serving_responses, serving_pooling):
        app.include_router(module.router)
    if settings.allow_runtime_lora_updating:
        app.include_router(serving_lora.router)
    engine.hooks.hook.add_routes(app=app, engine=engine, context=engine.hooks.context)
    app.openapi = lambda: openapi_document(app, bool(settings.api_key))
    return app


def openapi_document(app: FastAPI, api_key: bool) -> dict[str, Any]:
    """FastAPI's OpenAPI document of ``app`` (built once) as the server answers: without the 422
    FastAPI documents for every route that takes input (a validation error is a 400 here, which
    the routes document), and with the 401 of every guarded path when the server has an API key."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, operations in document["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if api_key and path not in OPEN_PATHS:
                    operation["responses"]["401"] = {"description": ERROR_DESCRIPTIONS[401], "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for name in ("HTTPValidationError", "ValidationError"):
            document.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = document
    return app.openapi_schema
