"""OpenAI-shaped errors, ``{"error": {"message", "type", "param", "code"}}``, and the app's handlers for them.

Bad input is a 400 naming the field, a failed engine step a 500 for the requests it held, an
engine that has shut down a 503. Every other error has the same shape: an unknown path is a 404,
a wrong method a 405 (Starlette's ``HTTPException``), and an unexpected exception a 500.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from hookllm.engine.async_llm import EngineDeadError, EngineStepError
from hookllm.server.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code if code else status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def engine_error(exc: Exception) -> OpenAIError:
    """The engine's exceptions as HTTP errors: bad input 400, a failed step 500, shut down 503."""
    if isinstance(exc, ValueError):
        return OpenAIError(400, str(exc))
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, str(exc), "internal_server_error")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), "service_unavailable")
    raise exc


async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that is not JSON, or a field of the wrong type or out of range (``param`` names it): 400."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                              "invalid_request_error")
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return error_response(400, f"{param or 'body'}: {first['msg']}", "invalid_request_error", param)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (FastAPI's too), such as an unknown path (404) or a wrong method
    (405, with its ``Allow`` header): the path is the client's own, the detail Starlette's."""
    type_ = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
    return error_response(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})", type_,
                          headers=exc.headers)


async def internal_error(_: Request, exc: Exception) -> JSONResponse:
    """Any exception no other handler took: a 500 naming only its type (its message may hold
    server paths); Starlette still logs the traceback."""
    return error_response(500, f"internal server error ({type(exc).__name__}); the server's log has the details",
                          "internal_server_error")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
