"""Connections that misbehave (issue "Security of every deployment shape", item 5), against a live
server: headers or a body trickled a byte at a time, a stream nobody reads, a foreign Host header,
an upgrade request, too many connections; and how the API key may be given."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from live_server import ServerProcess


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--header-timeout", "1", "--body-timeout", "1", "--send-timeout", "1",
                            "--limit-concurrency", "6")
    yield process
    process.stop()


def _connect(server: ServerProcess, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer is not None:  # before connect: the window the server sees
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        # and small segments: on loopback (64 KiB segments) the server's send buffer would grow
        # to megabytes before its writer pauses
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", server.port))
    sock.settimeout(30)
    return sock


def _read_response(sock: socket.socket) -> str:
    """One whole HTTP response (headers, then Content-Length bytes): recv may return it in pieces."""
    def more() -> bytes:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection before its whole response"
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += more()
    return (head + b"\r\n\r\n" + body).decode()


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed the connection (EOF or reset), False if it is still open
    when the socket's timeout passes."""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_headers_trickled_byte_by_byte_are_cut_off(server):
    sock = _connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    closed = False
    for byte in b"X-Slow: " + b"a" * 30:  # one byte each 0.5 s: every one would reset uvicorn's own timer
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        time.sleep(0.5)
    sock.settimeout(5)
    assert closed or _closed_by_server(sock)
    assert "no complete request headers within 1 s" in server.output()


def test_a_body_that_does_not_arrive_is_a_408(server):
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    response = _read_response(sock)
    assert response.startswith("HTTP/1.1 408"), response
    body = json.loads(response.partition("\r\n\r\n")[2])
    assert "--body-timeout" in body["error"]["message"]
    sock.close()


def test_a_stream_nobody_reads_is_aborted(server):
    sock = _connect(server, receive_buffer=4096)
    # 8 prompts x 4 sequences with 5 logprobs a token: ~10 KB of events a step fills the socket
    # buffers (a 4 KiB receive window, the sender's buffer, asyncio's 64 KiB) in a few steps.
    body = json.dumps({"prompt": [f"Story {i}: once upon a time" for i in range(8)], "max_tokens": 3000,
                       "ignore_eos": True, "n": 4, "logprobs": 5, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    # The client reads nothing: the socket buffers fill, the server's writer pauses, and one second
    # later the server gives up on the connection and aborts the requests (32 x 3000 tokens would
    # otherwise run for many minutes).
    deadline = time.monotonic() + 120
    while "read nothing for 1 s" not in server.output():
        assert time.monotonic() < deadline, server.output()[-2000:]
        time.sleep(0.5)
    while httpx.get(server.url + "/get_load").json()["num_running"]:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.5)
    sock.close()


def test_a_foreign_host_header_is_refused_on_a_keyless_local_server(server):
    refused = httpx.get(server.url + "/v1/models", headers={"Host": "rebound.example:8000"})
    assert refused.status_code == 400
    assert "rebound.example" in refused.json()["error"]["message"]
    assert "--allowed-hosts" in refused.json()["error"]["message"]
    for host in ("localhost:8000", f"127.0.0.1:{server.port}", "[::1]:1"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}).status_code == 200


def test_an_upgrade_request_is_never_switched(server):
    response = httpx.get(server.url + "/health", headers={
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert response.status_code == 200  # answered as plain HTTP, not 101 Switching Protocols
    assert response.json() == {"status": "ok"}


def test_connections_over_the_limit_get_503(server):
    idle = [_connect(server) for _ in range(6)]  # each counts until the header deadline closes it
    try:
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/health").status_code != 200:  # the slots come back
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _serve_fails(*flags: str, env: dict[str, str] | None = None) -> str:
    """`roseinfer serve` that must refuse to start; its output."""
    result = subprocess.run([sys.executable, "-m", "roseinfer.cli", "serve", "--port", "1", *flags],
                            capture_output=True, text=True, timeout=120, env=os.environ | (env or {}))
    assert result.returncode != 0
    return result.stdout + result.stderr


def test_an_empty_api_key_is_refused(tmp_path):
    assert "is empty" in _serve_fails("--api-key", "")
    assert "is empty" in _serve_fails(env={"ROSEINFER_API_KEY": " "})
    (tmp_path / "empty").write_text("\n")
    assert "is empty" in _serve_fails("--api-key-file", str(tmp_path / "empty"))
    assert "give it one way" in _serve_fails("--api-key", "a", env={"ROSEINFER_API_KEY": "b"})
    assert "cannot read" in _serve_fails("--api-key-file", str(tmp_path / "missing"))


def test_the_key_from_a_file_and_from_the_environment(tmp_path):
    (tmp_path / "key").write_text("file-key\n")
    for flags, env, key in (
        (("--api-key-file", str(tmp_path / "key")), None, "file-key"),
        ((), {"ROSEINFER_API_KEY": "env-key"}, "env-key"),
    ):
        server = ServerProcess(*flags, env=env)
        try:
            assert httpx.get(server.url + "/v1/models").status_code == 401
            ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
            # with a key the Host check is off by default: the key is what protects it
            assert httpx.get(server.url + "/v1/models", headers={
                "Authorization": f"Bearer {key}", "Host": "any.example"}).status_code == 200
        finally:
            server.stop()
