"""The HTTP server: the app, OpenAI-style errors, the server-wide middleware (API key, body
limits, hosts), and the API families, each a module with its own router (`API_FAMILIES`).

With an API key every route but the chat page, /health and /metrics needs it (those two too with
`protect_metrics`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from roseinfer.engine.async_llm import AsyncLLM
from roseinfer.errors import EngineDeadError, RoseInferError
from roseinfer.server import (
    anthropic_api,
    embeddings_api,
    generate_api,
    health_api,
    metrics_api,
    ollama_api,
    openai_api,
    responses_api,
    tokenize_api,
    web_ui,
)
from roseinfer.server.api_family import ApiContext, ApiError, ApiFamily
from roseinfer.server.error_responses import GenerationError, error_response, response_for
from roseinfer.server.metrics import PrometheusStatLogger
from roseinfer.server.middleware import ApiKeyGuard, BodyDeadline, BodyLimit, ErrorGuard, HostGuard
from roseinfer.server.protocol import MAX_NESTING_DEPTH, UNSUPPORTED_FIELDS
from roseinfer.server.response_store import ResponseStore
from roseinfer.server.serving import OpenAIServing

logger = logging.getLogger("roseinfer.server")

# Open with an API key too, as vLLM keeps them: load balancers probe /health, Prometheus scrapes
# /metrics (`protect_metrics` closes both); the chat page sends the key itself.
OPEN_PATHS = {"/", "/health", "/metrics", "/get_load"}
OPEN_PREFIXES = ("/static/",)

# The API families, in the order their routes are added (and /openapi.json lists them). Anthropic's
# last: the middleware that gives its routes Anthropic's error shape must wrap all the others.
API_FAMILIES: list[ApiFamily] = [
    health_api,  # GET /health, GET /get_load
    openai_api,  # GET /v1/models, POST /v1/completions, POST /v1/chat/completions
    generate_api,  # the seed's POST /generate
    metrics_api,  # GET /metrics (Prometheus)
    web_ui,  # the chat page at / (and /static/)
    responses_api,  # POST /v1/responses, GET and DELETE /v1/responses/{id}
    tokenize_api,  # POST /tokenize, POST /detokenize
    embeddings_api,  # POST /v1/embeddings
    ollama_api,  # Ollama's /api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/ps, ...
    anthropic_api,  # POST /v1/messages, POST /v1/messages/count_tokens
]


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
    allow_pull: bool = False,
) -> FastAPI:
    """The app over a started AsyncLLM (whose engine core runs beside the event loop); `metrics`
    is the stat logger the engine feeds. `app.state.begin_shutdown(timeout)` starts a graceful
    shutdown (see there)."""
    model_name = served_model_name or engine.model_name
    context = ApiContext(engine, OpenAIServing(engine, model_name, tool_call_parser), model_name, metrics,
                         response_store if response_store is not None else ResponseStore(), enable_web_ui,
                         allow_pull)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("serving %s; engine loop started", model_name)
        yield
        engine.shutdown()
        logger.info("engine loop stopped")

    app = FastAPI(title="roseinfer", lifespan=lifespan)
    app.state.engine = engine

    def begin_shutdown(timeout: float) -> None:
        """New requests get 503 from now on; requests still running `timeout` seconds later end
        with an error (a stream: an error event, then [DONE]), so every client hears why."""
        engine.refuse_new_requests("the server is shutting down")
        asyncio.get_running_loop().call_later(timeout, engine.end_all_requests, EngineDeadError(
            f"the server is shutting down and the request did not finish within {timeout:g} s "
            "(--shutdown-timeout)"))

    app.state.begin_shutdown = begin_shutdown

    # -- errors: OpenAI's shape (an API family may reshape its own, as Anthropic's does) ------
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

    # -- the server-wide middleware, then the API families (whose own middleware wraps it) ---
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
    app.add_middleware(ErrorGuard, respond=error_response)  # the outermost of the server's own
    for family in API_FAMILIES:
        family.register(app, context)
    return app
