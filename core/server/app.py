"""The OpenAI-compatible FastAPI app over an ``AsyncLLM``: the routes of ``serving_*`` over one
``ServerState``, the error handlers, the API key check, and the plugins' routes."""

from __future__ import annotations

import contextlib
import hmac
from importlib import metadata
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI

from hookllm.engine.async_llm import AsyncLLM
from hookllm.server import serving_basic, serving_chat, serving_completion, serving_responses
from hookllm.server.errors import add_error_handlers, error_response
from hookllm.server.metrics import ServerMetrics
from hookllm.server.state import ServerSettings, ServerState

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
                                          "authentication_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The app serving ``engine``; plugins' ``add_routes`` hooks add their routes last."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()  # uvicorn has drained (or timed out) the connections: stop the engine

    app = FastAPI(title="hookllm", version=metadata.version("hookllm"), lifespan=lifespan)
    app.state.server = ServerState(engine, settings, ServerMetrics(engine, settings.served_model_names[0]))
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    add_error_handlers(app)
    for module in (serving_basic, serving_completion, serving_chat, serving_responses):
        app.include_router(module.router)
    engine.hooks.hook.add_routes(app=app, engine=engine, context=engine.hooks.context)
    return app
