"""What every API family module shares: the `ApiContext` its `register(app, context)` receives
(the engine, the shared serving, the model check) and the helpers its routes use.

An API family is one module with its own `APIRouter` and a `register(app, context)` function;
app.py lists them in `API_FAMILIES`, in the order their routes are added.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from roseinfer.engine.async_llm import AsyncLLM
from roseinfer.server.metrics import PrometheusStatLogger
from roseinfer.server.response_store import ResponseStore
from roseinfer.server.serving import OpenAIServing

logger = logging.getLogger("roseinfer.server")


class ApiError(Exception):
    """An error a route answers with directly (the app's handler gives it OpenAI's error shape)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class ApiContext:
    engine: AsyncLLM
    serving: OpenAIServing  # the request -> engine plumbing every generation route shares
    model_name: str  # the name clients must use (--served-model-name, or the model's own)
    metrics: PrometheusStatLogger
    response_store: ResponseStore
    enable_web_ui: bool = True
    allow_pull: bool = False  # whether clients may download models (Ollama's /api/pull; --allow-pull)

    def check_model(self, name: str | None) -> None:
        """A 404 for a request naming a model this server does not serve (None: any is fine)."""
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")


class ApiFamily(Protocol):
    """A module of routes: `register` adds its router (and any middleware of its own) to the app."""

    def register(self, app: FastAPI, context: ApiContext) -> None: ...


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Response:
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
