"""The HTTP server: FastAPI routes, OpenAI-style errors, API keys, and `roseinfer serve`.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /generate (the seed's), GET /metrics (Prometheus), GET /get_load (for load balancers).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from roseinfer.engine.async_llm import AsyncLLM
from roseinfer.errors import (
    ContextLengthError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from roseinfer.server.metrics import CONTENT_TYPE, PrometheusStatLogger
from roseinfer.server.protocol import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
)
from roseinfer.server.serving import OpenAIServing

logger = logging.getLogger("roseinfer.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                503: "overloaded_error"}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None) -> JSONResponse:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "server_error"), param=param,
                     code=code if code is not None else status)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    # Unknown fields first: they explain the other errors a misspelt field causes.
    errors = sorted(errors, key=lambda e: e.get("type") != "extra_forbidden")
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    if first.get("type") == "extra_forbidden":
        name = location[-1] if location else "?"
        if len(location) == 1 and name in UNSUPPORTED_FIELDS:
            return f"{name}: not supported by this server: {UNSUPPORTED_FIELDS[name]}", param
        return (f"unknown field {param!r}: neither the OpenAI API nor vLLM's extensions define it here "
                "(see the README for the accepted fields)"), param
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if first.get("type") == "missing":
        return f"{param} is required", param
    message = first.get("msg", "invalid request")
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{param}: {message}{extra}" if param else f"{message}{extra}"), param


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Response:
    """Run a whole-response request; cancel it (which aborts its engine requests) if the client
    disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            result = task.result()
            return JSONResponse(result.model_dump() if isinstance(result, BaseModel) else result)
        task.cancel()
        logger.info("%s: client disconnected; request aborted", request.url.path)
        return Response(status_code=499)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


def create_app(
    engine: AsyncLLM,
    metrics: PrometheusStatLogger,
    served_model_name: str | None = None,
    api_key: str | None = None,
    enable_web_ui: bool = True,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The app over a started AsyncLLM (whose engine core runs beside the event loop); `metrics`
    is the stat logger the engine feeds."""
    model_name = served_model_name or engine.model_name
    serving = OpenAIServing(engine, model_name, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("serving %s; engine loop started", model_name)
        yield
        engine.shutdown()
        logger.info("engine loop stopped")

    app = FastAPI(title="roseinfer", lifespan=lifespan)
    app.state.engine = engine

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           "model", "model_not_found")

    # -- errors -------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(ContextLengthError)
    async def _context_error(_: Request, exc: ContextLengthError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, "context_length_exceeded")

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_: Request, exc: EngineOverloadedError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    # -- routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return error_response(503, "the engine loop is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/get_load")
    async def get_load() -> Response:
        """Requests in flight (running and waiting): what a router's least-load policy compares
        (vllm-router's and sglang-router's power_of_two poll this route)."""
        return JSONResponse({"load": engine.num_running + engine.num_waiting,
                             "num_running": engine.num_running, "num_waiting": engine.num_waiting})

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=engine.model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(check_api_key)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        submitted = await serving.submit("/v1/completions", "cmpl", serving.completion_requests(body), body.n)
        if body.stream:
            return StreamingResponse(serving.completion_stream(body, submitted), media_type="text/event-stream")
        return await _unless_disconnected(request, serving.completion(body, submitted))

    @app.post("/v1/chat/completions", dependencies=[Depends(check_api_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        requests, tool_calling = serving.chat_requests(body)
        submitted = await serving.submit("/v1/chat/completions", "chatcmpl", requests, body.n, tool_calling)
        if body.stream:
            return StreamingResponse(serving.chat_stream(body, submitted), media_type="text/event-stream")
        return await _unless_disconnected(request, serving.chat(body, submitted))

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        check_api_key(request)
        submitted = await serving.submit("/generate", "gen", serving.generate_requests(body), 1)
        if body.stream:
            return StreamingResponse(serving.generate_stream(submitted), media_type="text/plain; charset=utf-8")
        return await _unless_disconnected(request, serving.generate(submitted))

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if enable_web_ui:  # the chat page at / (open to all; the page sends the API key itself)
        from roseinfer.server.web_ui import add_web_ui

        add_web_ui(app)
    return app
