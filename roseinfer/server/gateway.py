"""The front door of `roseinfer serve --data-parallel-size N`: the router's own routes never face clients.

vllm-router (like sglang-router) answers administrative routes on the port it serves: `POST
/add_worker?url=...` makes it send users' prompts to any address, `/remove_worker` and
`/flush_cache` disrupt the replicas, and it authenticates none of its clients (its `--api-key` is
the key it sends to the replicas). So the router listens on a private port of 127.0.0.1, and this
gateway listens on `--host:--port`: the same API-key, Host, body-size and connection checks as a
single server, then only the serving routes forwarded, streamed both ways. The router's CORS
headers are not passed on: a web page gets no readable answer from it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from roseinfer.server.error_responses import error_response
from roseinfer.server.middleware import ApiKeyGuard, BodyDeadline, BodyLimit, ErrorGuard, HostGuard

logger = logging.getLogger("roseinfer.server")

# What clients may reach: the API families and the chat page. Anything else (the router's
# /add_worker, /remove_worker, /list_workers, /flush_cache, /workers, ...) is a 404 here.
FORWARDED_PREFIXES = ("/v1/", "/static/")
FORWARDED_PATHS = {"/", "/health", "/generate", "/tokenize", "/detokenize"}
OPEN_PATHS = {"/", "/health"}
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones a proxy rewrites; CORS ones are the router's.
_DROPPED_REQUEST_HEADERS = {"host", "connection", "keep-alive", "proxy-connection", "te", "trailer",
                            "transfer-encoding", "upgrade", "content-length"}
_DROPPED_RESPONSE_HEADERS = _DROPPED_REQUEST_HEADERS | {"content-encoding"}


def forwarded(path: str) -> bool:
    return path in FORWARDED_PATHS or path.startswith(FORWARDED_PREFIXES)


def create_gateway(
    upstream: str,
    api_key: str | None,
    *,
    max_body_bytes: int,
    body_timeout: float | None,
    allowed_hosts: list[str] | None,
    protect_metrics: bool = False,
) -> Starlette:
    """An ASGI app forwarding the serving routes to `upstream` (the router's private URL)."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=10.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def forward(request: Request) -> Response:
        path = request.url.path
        if not forwarded(path):
            return error_response(404, f"{path} is not a route of this server")
        headers = [(name, value) for name, value in request.headers.raw
                   if name.decode("latin-1").lower() not in _DROPPED_REQUEST_HEADERS]
        upstream_request = client.build_request(
            request.method, httpx.URL(path=path, query=request.url.query.encode()), headers=headers,
            content=request.stream() if request.method in ("POST", "PUT", "PATCH") else None,
        )
        try:
            upstream_response = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            logger.warning("gateway: the router did not answer %s %s: %s", request.method, path, exc)
            return error_response(503, "the load balancer behind this server did not answer; retry shortly")
        response_headers = {name: value for name, value in upstream_response.headers.items()
                            if name.lower() not in _DROPPED_RESPONSE_HEADERS
                            and not name.lower().startswith("access-control-")}

        async def body() -> AsyncIterator[bytes]:
            async for chunk in upstream_response.aiter_raw():
                yield chunk

        # A client that leaves ends this response, which closes the upstream one: the router and
        # the replica see the disconnect and abort the request.
        return StreamingResponse(body(), status_code=upstream_response.status_code, headers=response_headers,
                                 background=BackgroundTask(upstream_response.aclose))

    async def http_error(_: Request, exc: HTTPException) -> Response:
        if exc.status_code == 413:
            return error_response(413, f"the request body is larger than this server's limit of {max_body_bytes} "
                                       "bytes (--max-request-body-bytes)")
        return error_response(exc.status_code, str(exc.detail))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "DELETE", "PUT", "PATCH"])],
                    exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    if body_timeout:
        app.add_middleware(BodyDeadline, seconds=body_timeout)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, respond=lambda status, message: error_response(
        413, f"the request body is larger than this server's limit of {max_body_bytes} bytes "
             "(--max-request-body-bytes)"))
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key, open_paths=set() if protect_metrics else OPEN_PATHS,
                           open_prefixes=("/static/",),
                           respond=lambda status, message: error_response(status, message, code="invalid_api_key"))
    if allowed_hosts is not None:
        app.add_middleware(HostGuard, allowed=allowed_hosts, respond=error_response)
    app.add_middleware(ErrorGuard, respond=error_response)
    return app
