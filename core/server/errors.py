"""OpenAI-shaped errors, ``{"error": {"message", "type", "param", "code"}}``, and the app's handlers for them.

Bad input is a 400 naming the field, a failed engine step a 500 for the requests it held, an
engine that has shut down a 503. Every other error has the same shape: an unknown path is a 404,
a wrong method a 405 (Starlette's ``HTTPException``), and an unexpected exception a 500.

``type`` follows from the status alone, with the words OpenAI's API uses (:func:`error_type`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from hookllm.engine.async_llm import EngineDeadError, EngineStepError
from hookllm.server.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return error_type(self.status)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code)


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status: its API answers every client error (a bad field, a
    wrong key, an unknown model or path) with ``invalid_request_error``, and its own failures
    with ``server_error``."""
    return "server_error" if status >= 500 else "invalid_request_error"


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The error body; ``code`` is the HTTP status unless a word says more (``model_not_found``)."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type(status), param=param,
                                         code=code if code else status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def engine_error(exc: Exception) -> OpenAIError:
    """The engine's exceptions as HTTP errors: bad input 400, a failed step 500, shut down 503."""
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc))
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, str(exc))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc))
    raise exc


ERROR_DESCRIPTIONS = {
    400: "Bad input: malformed JSON, or a field of the wrong type, out of range or not supported (`param` names it)",
    401: "A missing or wrong API key (`Authorization: Bearer ...`, with `--api-key`)",
    404: "Not found: the model (or LoRA adapter) named, or the response asked for",
    500: "A failed engine step (the server keeps serving other requests), or an unexpected error",
    503: "The engine has shut down",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=`` for the OpenAPI document: each of ``statuses`` with its ``ErrorResponse``."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


def generation_responses(answer: type[BaseModel], events: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route that runs the engine: ``answer`` whole, or with ``stream`` server-sent
    ``events``; bad input, an unknown model, a failed step, an engine shut down."""
    ok = {"model": answer, "content": {"text/event-stream": {}},
          "description": f"The answer; with `stream`, server-sent events: {events}"}
    return {200: ok, **error_responses(400, 404, 500, 503)}


async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that is not JSON, or a field of the wrong type or out of range (``param`` names it): 400."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    # A value that no member of a union takes fails every member: the member of the right type
    # says what is wrong with it (an empty prompt is a string too short, not a list of the wrong type).
    field = first.get("loc", ())[:2]
    first = next((error for error in errors if error.get("loc", ())[:2] == field
                  and not error["type"].endswith("_type")), first)
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not union_member(part)]
    param = ".".join(location) or None
    return error_response(400, f"{param or 'body'}: {first['msg']}", param)


def union_member(part: int | str) -> bool:
    """Whether a validation error's ``loc`` part is pydantic's name for a union's member
    (``constrained-str``, ``list[int]``, ``TextPart``) rather than a field or an index."""
    return isinstance(part, str) and (any(char in part for char in "[-") or part[:1].isupper())


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (FastAPI's too), such as an unknown path (404) or a wrong method
    (405, with its ``Allow`` header): the path is the client's own, the detail Starlette's."""
    return error_response(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})",
                          headers=exc.headers)


async def internal_error(_: Request, exc: Exception) -> JSONResponse:
    """Any exception no other handler took: a 500 naming only its type (its message may hold
    server paths); Starlette still logs the traceback."""
    return error_response(500, f"internal server error ({type(exc).__name__}); the server's log has the details")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
