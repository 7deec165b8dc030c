"""A pass-through HTTP proxy in front of a live server that records every exchange (method, path,
status, request body, response body) as the client saw it, streamed responses relayed chunk by
chunk as they come. Agent CLIs are pointed at it: the test then reads what each CLI asked and
what the server answered, byte for byte."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself.
_SKIPPED = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
            "content-length", "host", "accept-encoding", "content-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    request: bytes
    response: bytes
    content_type: str
    client_left: bool = False  # the client closed the connection before the response's end

    def request_json(self) -> dict:
        return json.loads(self.request) if self.request else {}

    def events(self) -> list[dict]:
        """A server-sent-event stream's JSON payloads (the `data:` lines), in order."""
        return [json.loads(line[5:]) for line in self.response.decode().splitlines()
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]

    def json(self) -> dict:
        return json.loads(self.response)


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._client = httpx.Client(base_url=upstream, timeout=httpx.Timeout(900, connect=10))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # the exchanges are the log
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _SKIPPED}
                with proxy._lock:
                    proxy._in_flight += 1
                try:
                    self._forward(body, headers)
                finally:
                    with proxy._lock:
                        proxy._in_flight -= 1
                        proxy._idle.notify_all()

            def _forward(self, body: bytes, headers: dict[str, str]) -> None:
                received, left = bytearray(), False
                with proxy._client.stream(self.command, self.path, content=body, headers=headers) as upstream:
                    try:
                        self.send_response(upstream.status_code)
                        for key, value in upstream.headers.items():
                            if key.lower() not in _SKIPPED:
                                self.send_header(key, value)
                        chunked = self.command != "HEAD"
                        self.send_header(*(("transfer-encoding", "chunked") if chunked else ("content-length", "0")))
                        self.end_headers()
                        for chunk in upstream.iter_raw():
                            received += chunk
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                        if chunked:
                            self.wfile.write(b"0\r\n\r\n")
                            self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        left = True
                    finally:  # also where the client left before the end: what it was sent
                        with proxy._lock:
                            proxy.exchanges.append(Exchange(self.command, self.path, upstream.status_code, body,
                                                            bytes(received), upstream.headers.get("content-type", ""),
                                                            left))

            def _read_chunked(self) -> bytes:
                body = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return bytes(body)
                    body += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def take(self, timeout: float = 60) -> list[Exchange]:
        """The exchanges recorded since the last take, once none is in flight (a client that
        exits may leave a request of its own still being answered)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout)
            taken, self.exchanges = self.exchanges, []
        return taken

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()
