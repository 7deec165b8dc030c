"""ASGI middleware around the app: the API key, checked before anything else is read; the body
size limit; and a last guard that turns an unexpected exception into an error response without costing the client its
connection.

Starlette's own fallback for unhandled exceptions answers 500 and then re-raises, and uvicorn then
closes the connection; the guard here answers and returns instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("roseinfer.server")

ErrorResponder = Callable[[int, str], Response]


class ApiKeyGuard:
    """`Authorization: Bearer <key>` (or `x-api-key: <key>`, the header Anthropic's clients send)
    on every HTTP route but the open ones (the chat page and its files, and whatever `open_paths`
    lists), checked before the body is read. The key is compared as UTF-8 bytes in constant time,
    so any key and any header value can be compared."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: set[str], open_prefixes: tuple[str, ...],
                 respond: ErrorResponder) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = self.respond(401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                                     "(or 'x-api-key: <key>')")
        await response(scope, receive, send)

    def _is_open(self, path: str) -> bool:
        return path in self.open_paths or path.startswith(self.open_prefixes)

    def _authorized(self, scope: Scope) -> bool:
        """Whether an Authorization header (Bearer) or an x-api-key header holds the key."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key):
                    return True
            elif name == b"x-api-key" and secrets.compare_digest(value.strip(), self.key):
                return True
        return False


class BodyLimit:
    """Refuse a request body over `max_bytes` with a 413: at once when its Content-Length says so,
    else as soon as the bytes read pass it (the HTTPException reaches the app's handler, which
    names the limit). Starlette's own limiter answers in plain text, not with an error object."""

    def __init__(self, app: ASGIApp, max_bytes: int, respond: ErrorResponder) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.respond(413, "")(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413)
            return message

        await self.app(scope, limited_receive, send)


class BodyDeadline:
    """The whole request body must arrive within `seconds` of the first read: a client trickling a
    body a byte at a time would otherwise hold a connection and a request slot for ever. A late
    body is a 408 naming the limit (raised where the app reads it, answered by its handler)."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline: float | None = None
        complete = False

        async def timed_receive() -> Message:
            nonlocal deadline, complete
            if complete:  # after the body only a disconnect can arrive: no deadline on waiting for it
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.seconds
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.seconds:g} s "
                                         "(--body-timeout)") from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


class HostGuard:
    """Only requests whose Host header names one of `allowed` (a name, any port; "*" for any): a
    keyless server on 127.0.0.1 is otherwise reachable from any web page through DNS rebinding
    (evil.example resolving to 127.0.0.1 makes the browser send the page's requests here)."""

    def __init__(self, app: ASGIApp, allowed: list[str], respond: ErrorResponder) -> None:
        self.app = app
        self.allowed = {name.lower().encode() for name in allowed}
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or b"*" in self.allowed or _host_name(scope) in self.allowed:
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        response = self.respond(400, f"the Host header {host!r} is not one this server answers to; allowed: "
                                     f"{', '.join(sorted(name.decode() for name in self.allowed))} "
                                     "(--allowed-hosts)")
        await response(scope, receive, send)


def _host_name(scope: Scope) -> bytes:
    """The Host header's name without its port ([::1]:8000 -> [::1])."""
    host = dict(scope["headers"]).get(b"host", b"").lower()
    if host.startswith(b"["):
        return host.partition(b"]")[0] + b"]"
    return host.partition(b":")[0]


class ErrorGuard:
    """The outermost guard: an exception that escaped every handler is logged once and answered
    with a 500 error object (or, once the response has started, the body is ended cleanly); a
    client that went away while its body was being read is one INFO line."""

    def __init__(self, app: ASGIApp, respond: ErrorResponder) -> None:
        self.app = app
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            logger.info("%s %s: the client went away while sending its request", scope["method"], scope["path"])
        except Exception as exc:
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if not started:
                response = self.respond(500, f"internal error: {type(exc).__name__}: {exc}")
                await response(scope, receive, send)
            else:  # best effort: a streamed body cut short still ends as a valid HTTP message
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


class ErrorReshape:
    """On the routes under `prefix`, every error response (whoever answered it: the API key guard,
    the body limit, a route's handler, the last-resort guard) has its body rewritten by
    `reshape(status, body)` from the server's OpenAI error object into its API family's own shape.
    Added outermost, so that it sees them all; other responses pass through untouched."""

    def __init__(self, app: ASGIApp, prefix: str, reshape: Callable[[int, bytes], bytes]) -> None:
        self.app = app
        self.prefix = prefix
        self.reshape = reshape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def reshaping_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            body = self.reshape(start["status"], body)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping_send)


def error_message_of(status: int, body: bytes) -> str:
    """The message of an error response's body (the server's OpenAI error object, a framework's
    {"detail": ...}, or text); an empty body says what the status means."""
    import json

    message = None
    try:
        value = json.loads(body) if body else None
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("error"), dict):
        message = value["error"].get("message")
    elif isinstance(value, dict) and isinstance(value.get("detail"), str):
        message = value["detail"]
    if not isinstance(message, str):
        message = body.decode(errors="replace") or f"HTTP {status}"
    return message
