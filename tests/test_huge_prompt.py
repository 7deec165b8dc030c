"""A huge prompt leaves the server free while it is tokenized: a second request's first streamed
token arrives before the first request's response has begun.

The huge prompt (about 3.6M characters: 3-4 s of tokenizing on an idle core; a 900k one took
0.8 s, less than the wait below) has more tokens than the context, so its whole answer is a 400
`context_length_exceeded` sent the moment its tokenizing ends: no engine work follows it. Its response not having begun therefore means it is still being tokenized.
The verdict is an order of events (which response came first), not a duration.
"""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
from live_server import ServerProcess

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "x1y2", "Hello,", "world!", "\n"]


def huge_prompt(chars: int) -> str:
    rng = random.Random(0)
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(f"{rng.choice(WORDS)}{rng.randint(0, 999)}")
        size += len(words[-1]) + 1
    return " ".join(words)


def has_bytes(sock: socket.socket) -> bool:
    """Whether anything of the response has arrived on `sock` (without reading it)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def read_response(sock: socket.socket) -> tuple[int, dict]:
    sock.settimeout(600)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(head.split(b" ")[1]), json.loads(body)


def test_a_huge_prompt_being_tokenized_leaves_other_requests_served():
    prompt = huge_prompt(3_600_000)
    server = ServerProcess("--kv-cache-memory", "0.25", "--max-prompt-chars", "4000000")
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
        big = socket.create_connection(("127.0.0.1", server.port))
        big.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # Time for the server to read the body and hand the prompt to its tokenizer: without it the
        # second request could slip in first even where tokenizing blocks the server. The verdict
        # below does not depend on it.
        time.sleep(0.5)
        with httpx.Client(base_url=server.url, timeout=600) as http:
            assert http.get("/health").status_code == 200
            with http.stream("POST", "/v1/completions",
                             json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as short:
                assert short.status_code == 200
                lines = short.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                big_started = has_bytes(big)
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]", rest
        assert "choices" in json.loads(first.removeprefix("data: "))
        assert not big_started, "the huge prompt's response began before the short request's first token"
        status, answer = read_response(big)
        big.close()
        # It was only ever tokenized: too many tokens for the context.
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    finally:
        assert server.stop() == 0, server.output()
