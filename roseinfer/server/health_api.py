"""What load balancers poll: GET /health (200 while the engine runs, else 503) and GET /get_load
(requests running and waiting)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from roseinfer.server.api_family import ApiContext
from roseinfer.server.error_responses import error_response
from roseinfer.server.openapi import errors

HEALTHY = {200: {"content": {"application/json": {"schema": {
    "type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}}}}}


def register(app: FastAPI, context: ApiContext) -> None:
    engine = context.engine
    router = APIRouter()

    @router.get("/health", responses=HEALTHY | errors(401, 503))
    async def health() -> Response:
        if not engine.alive:
            return error_response(503, "the engine loop is not running")
        return JSONResponse({"status": "ok"})

    @router.get("/get_load")
    async def get_load() -> Response:
        """Requests in flight (running and waiting): what a router's least-load policy compares
        (vllm-router's and sglang-router's power_of_two poll this route)."""
        return JSONResponse({"load": engine.num_running + engine.num_waiting,
                             "num_running": engine.num_running, "num_waiting": engine.num_waiting})

    app.include_router(router)
