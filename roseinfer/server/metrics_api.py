"""GET /metrics: the engine's figures in Prometheus' text format (see metrics.py), for scraping."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response

from roseinfer.server.api_family import ApiContext
from roseinfer.server.metrics import CONTENT_TYPE
from roseinfer.server.openapi import errors


def register(app: FastAPI, context: ApiContext) -> None:
    metrics = context.metrics
    router = APIRouter()

    @router.get("/metrics", response_class=Response, responses={200: {
        "description": "The metrics in Prometheus' text format.",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }} | errors(401))
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(router)
