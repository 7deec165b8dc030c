"""Deadlines on a connection that uvicorn does not enforce itself, at the protocol level.

- Headers: uvicorn's keep-alive timer is cancelled by every byte received, so a client sending a
  request's headers one byte at a time holds a connection for ever (slowloris). Here the request's
  headers must be complete within `header_timeout` seconds of the connection opening or of the
  previous response ending, else the connection is closed.
- Sending: a client that stops reading a stream fills the socket buffers; uvicorn then pauses the
  response's writer until the client reads again, which may be never, and the request keeps its
  sequence slots meanwhile. Here a writer paused for `send_timeout` seconds aborts the connection:
  the app hears a disconnect, and a stream's engine request is aborted as for any client that left.

The body's own deadline is an ASGI middleware (`middleware.BodyDeadline`): the app reads the body.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("roseinfer.server")


def guarded_protocol(header_timeout: float, send_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the two deadlines (seconds; 0 turns one off)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle and self._header_timer is not None:  # a request's headers are in
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            self._await_headers()  # first: the next, pipelined request may already be complete
            super().on_response_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            if send_timeout > 0 and self._send_timer is None:
                self._send_timer = self.loop.call_later(send_timeout, self._stopped_reading)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _await_headers(self) -> None:
            if header_timeout > 0:
                if self._header_timer is not None:
                    self._header_timer.cancel()
                self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                logger.info("%s: no complete request headers within %g s (--header-timeout); connection closed",
                            _peer(self.client), header_timeout)
                self.transport.close()

        def _stopped_reading(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing():
                logger.warning("%s: the client read nothing for %g s (--send-timeout); connection closed and "
                               "its request aborted", _peer(self.client), send_timeout)
                self.transport.abort()

        def _cancel_timers(self) -> None:
            for timer in (self._header_timer, self._send_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._send_timer = None

    return GuardedH11Protocol


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
