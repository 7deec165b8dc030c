"""OpenAI's error object, and which HTTP status and error type each failure gets.

Every error the server sends, whole or as the last event of a stream, is built here, so a client
sees one shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from roseinfer.errors import (
    ContextLengthError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestTimeoutError,
)
from roseinfer.outputs import CompletionOutput
from roseinfer.server.protocol import ErrorInfo, ErrorResponse


class GenerationError(RuntimeError):
    """A request ended with finish_reason "error" (the engine step that ran it failed)."""


def generation_failure(completion: CompletionOutput) -> Exception:
    """The error of a sequence that ended with finish_reason "error": a 400 naming the field when
    the request itself was at fault (its grammar did not compile), else a 500."""
    if completion.error_param is not None:
        return InvalidRequestError(str(completion.error), param=completion.error_param)
    return GenerationError(f"generation failed: {completion.error}")


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 503:
        return "overloaded_error"
    if status == 408:
        return "timeout_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    info = ErrorInfo(message=message, type=error_type(status), param=param, code=code if code is not None else status)
    return ErrorResponse(error=info).model_dump()


def error_response(
    status: int, message: str, param: str | None = None, code: str | int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def status_of(exc: BaseException) -> int:
    if isinstance(exc, InvalidRequestError):
        return 400
    if isinstance(exc, RequestTimeoutError):
        return 408
    if isinstance(exc, EngineOverloadedError | EngineDeadError):
        return 503
    return 500


def _message(exc: BaseException) -> str:
    if status_of(exc) != 500 or isinstance(exc, GenerationError):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"


def response_for(exc: BaseException) -> JSONResponse:
    """The error response of an exception from the engine (or of an unexpected one: a 500)."""
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, EngineOverloadedError) else None
    return error_response(status_of(exc), _message(exc), getattr(exc, "param", None), code, headers)


def error_event(exc: BaseException) -> dict:
    """The error object a stream sends as its last event when its request fails after the
    response has started."""
    return error_body(status_of(exc), _message(exc), getattr(exc, "param", None))
