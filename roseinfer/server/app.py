"""The HTTP server: FastAPI routes, OpenAI-style errors, API keys, and `roseinfer serve`.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /generate (the seed's), GET /metrics (Prometheus), GET /get_load (for load balancers); other
API families in modules of their own (anthropic_api: POST /v1/messages[/count_tokens];
tokenize_api: POST /tokenize, /detokenize; responses_api: /v1/responses). With an
API key every route but the chat page, /health and /metrics needs it (those two too with
`protect_metrics`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from roseinfer.engine.async_llm import AsyncLLM
from roseinfer.errors import EngineDeadError, RoseInferError
from roseinfer.server.error_responses import GenerationError, error_response, response_for
from roseinfer.server.metrics import CONTENT_TYPE, PrometheusStatLogger
from roseinfer.server.middleware import ApiKeyGuard, BodyDeadline, BodyLimit, ErrorGuard, HostGuard
from roseinfer.server.openapi import errors, finish_document, streamed
from roseinfer.server.protocol import (
    MAX_NESTING_DEPTH,
    UNSUPPORTED_FIELDS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    ModelList,
)
from roseinfer.server.response_store import ResponseStore
from roseinfer.server.serving import OpenAIServing, guarded_sse, guarded_text

logger = logging.getLogger("roseinfer.server")

# Open with an API key too, as vLLM keeps them: load balancers probe /health, Prometheus scrapes
# /metrics (`protect_metrics` closes both); the chat page sends the key itself.
OPEN_PATHS = {"/", "/health", "/metrics", "/get_load"}
OPEN_PREFIXES = ("/static/",)


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
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
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
    disconnects first. Both tasks are awaited to the end, so none is left pending."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        logger.info("%s: client disconnected; request aborted", request.url.path)
        return Response(status_code=499)
    result = task.result()  # its error, if any, goes to the exception handlers
    return JSONResponse(result.model_dump() if isinstance(result, BaseModel) else result)


def create_app(
    engine: AsyncLLM,
    metrics: PrometheusStatLogger,
    served_model_name: str | None = None,
    api_key: str | None = None,
    enable_web_ui: bool = True,
    tool_call_parser: str | None = None,
    *,
    max_body_bytes: int | None = None,
    protect_metrics: bool = False,
    body_timeout: float | None = None,
    allowed_hosts: list[str] | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The app over a started AsyncLLM (whose engine core runs beside the event loop); `metrics`
    is the stat logger the engine feeds. `app.state.begin_shutdown(timeout)` starts a graceful
    shutdown (see there)."""
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
    finish_document(app, extra_models=[ChatCompletionChunk])

    def begin_shutdown(timeout: float) -> None:
        """New requests get 503 from now on; requests still running `timeout` seconds later end
        with an error (a stream: an error event, then [DONE]), so every client hears why."""
        engine.refuse_new_requests("the server is shutting down")
        asyncio.get_running_loop().call_later(timeout, engine.end_all_requests, EngineDeadError(
            f"the server is shutting down and the request did not finish within {timeout:g} s "
            "(--shutdown-timeout)"))

    app.state.begin_shutdown = begin_shutdown

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

    @app.exception_handler(RoseInferError)
    async def _engine_error(_: Request, exc: RoseInferError) -> JSONResponse:
        return response_for(exc)

    @app.exception_handler(GenerationError)
    async def _generation_error(_: Request, exc: GenerationError) -> JSONResponse:
        logger.error("request failed: %s", exc)
        return response_for(exc)

    def too_large() -> JSONResponse:
        return error_response(413, f"the request body is larger than this server's limit of {max_body_bytes} "
                                   "bytes (--max-request-body-bytes)")

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 413:
            return too_large()
        if isinstance(exc.__cause__, RecursionError):  # a body too deep for the JSON parser itself
            return error_response(400, "the request body nests lists and objects too deeply to parse; a field "
                                       f"may nest them at most {MAX_NESTING_DEPTH} levels deep")
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    # -- routes ---------------------------------------------------------------------------
    @app.get("/health", responses={200: {"content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}}}}} | errors(401, 503))
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

    @app.get("/v1/models", responses=errors(401))
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=engine.model_name, max_model_len=engine.max_model_len)])

    generation_errors = errors(400, 401, 404, 408, 413, 500, 503)

    @app.post("/v1/completions", responses=streamed(CompletionResponse, CompletionResponse) | generation_errors)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        submitted = await serving.submit("/v1/completions", "cmpl", serving.completion_requests(body), body.n)
        if body.stream:
            return StreamingResponse(guarded_sse(serving.completion_stream(body, submitted)),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request, serving.completion(body, submitted))

    @app.post("/v1/chat/completions", responses=streamed(ChatCompletionResponse, ChatCompletionChunk) | generation_errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        requests, tool_calling = serving.chat_requests(body)
        submitted = await serving.submit("/v1/chat/completions", "chatcmpl", requests, body.n, tool_calling)
        if body.stream:
            return StreamingResponse(guarded_sse(serving.chat_stream(body, submitted)),
                                     media_type="text/event-stream")
        return await _unless_disconnected(request, serving.chat(body, submitted))

    @app.post("/generate", responses={200: {
        "model": GenerateResponse,
        "description": "The whole response; with `stream: true`, the text as it is generated (plain "
                       "text; a request that fails after the stream has started ends with a line "
                       "`[error] <message>`).",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }} | errors(400, 401, 408, 413, 500, 503))
    async def generate(body: GenerateRequest, request: Request) -> Response:
        submitted = await serving.submit("/generate", "gen", serving.generate_requests(body), 1)
        if body.stream:
            return StreamingResponse(guarded_text(serving.generate_stream(submitted)),
                                     media_type="text/plain; charset=utf-8")
        return await _unless_disconnected(request, serving.generate(submitted))

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "The metrics in Prometheus' text format.",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }} | errors(401))
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if enable_web_ui:  # the chat page at / (open to all; the page sends the API key itself)
        from roseinfer.server.web_ui import add_web_ui

        add_web_ui(app)

    if body_timeout:
        app.add_middleware(BodyDeadline, seconds=body_timeout)
    if max_body_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=max_body_bytes, respond=lambda status, message: too_large())
    if api_key is not None:
        open_paths = OPEN_PATHS - ({"/health", "/metrics", "/get_load"} if protect_metrics else set())
        app.add_middleware(ApiKeyGuard, api_key=api_key, open_paths=open_paths, open_prefixes=OPEN_PREFIXES,
                           respond=lambda status, message: error_response(status, message, code="invalid_api_key"))
    if allowed_hosts is not None:  # before the key: a rebinding page has no key, but say why
        app.add_middleware(HostGuard, allowed=allowed_hosts, respond=error_response)
    app.add_middleware(ErrorGuard, respond=error_response)  # added last: the outermost
    # API families of their own modules (imported here: they import this one). Anthropic's last:
    # its error shaping must wrap all the above.
    from roseinfer.server.anthropic_api import register_anthropic_api
    from roseinfer.server.embeddings_api import register_embeddings_api
    from roseinfer.server.responses_api import register_responses
    from roseinfer.server.tokenize_api import register_tokenize_api

    register_responses(app, serving, response_store if response_store is not None else ResponseStore(), check_model)
    register_tokenize_api(app, serving, check_model)
    register_embeddings_api(app, serving, check_model)
    register_anthropic_api(app, serving, check_model)
    return app
