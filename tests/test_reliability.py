"""What a hostile but fair client can do to `roseinfer serve`, each a test against a real server:
bad numbers and keys, the server's request limits, a failing model step, a slow body, errors on a
kept-alive connection, disconnects, SIGKILL then restart, and SIGTERM with streams in flight.

The server runs with small limits, an API key guarding everything (--protect-metrics), and the
model runner's test-only fault: a prompt holding token FAULT_TOKEN makes every step that runs it
raise, as a failing kernel would.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection

import httpx
import pytest
from live_server import ServerProcess, metric
from support import EXACT_FLAGS

from roseinfer.worker.fault_injection import FAULT_TOKEN_ENV

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAULT_TOKEN = 49000
SHUTDOWN_TIMEOUT = 2
REQUEST_TIMEOUT = 30  # long enough for the other tests on 2 busy cores
FLAGS = (*EXACT_FLAGS, "--api-key", KEY, "--protect-metrics", "--max-request-body-bytes", "20000", "--max-prompt-chars", "5000",
         "--max-stop", "4", "--max-stop-chars", "16", "--request-timeout", str(REQUEST_TIMEOUT),
         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT))
FAULT_ENV = {FAULT_TOKEN_ENV: str(FAULT_TOKEN)}
HELLO = [{"role": "user", "content": "Hello"}]
# Signs of errors the server did not handle: each closed a connection or leaked a task before.
UNHANDLED = ("Exception in ASGI application", "Task exception was never retrieved", "aclose()", "never awaited")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(*FLAGS, env=FAULT_ENV)
    yield process
    if process.process.poll() is None:
        process.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def greedy(prompt: str | list[int], max_tokens: int = 8, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra


IDLE = ("roseinfer:num_requests_running", "roseinfer:num_requests_waiting", "roseinfer:kv_cache_usage_perc")


def assert_idle_soon(server: ServerProcess) -> None:
    """Aborts take effect at the engine's next step: poll (bounded) until nothing runs, waits or
    holds KV blocks."""
    for _ in range(150):
        if not any(metric(server, name, AUTH) for name in IDLE):
            break
        time.sleep(0.2)
    assert [metric(server, name, AUTH) for name in IDLE] == [0, 0, 0]


# -- every input is validated before it is queued, with a message naming the field --------------

@pytest.mark.parametrize(
    ("path", "raw", "param", "message"),
    [
        ("/v1/completions", '{"prompt": "Hi", "seed": 18446744073709551616}', "seed", r"2\*\*64"),
        ("/v1/completions", '{"prompt": "Hi", "seed": -9223372036854775809}', "seed", r"-2\*\*63"),
        ("/generate", '{"prompt": "Hi", "do_sample": true, "seed": 18446744073709551616}', "seed", r"2\*\*64"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
         "temperature", "finite"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "repetition_penalty": Infinity}',
         "repetition_penalty", "finite"),
        ("/generate", '{"prompt": "Hi", "temperature": Infinity}', "temperature", "finite"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], '
         '"chat_template_kwargs": {"add_generation_prompt": false}}', "chat_template_kwargs", "add_generation_prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], '
         '"chat_template_kwargs": {"messages": []}}', "chat_template_kwargs", "messages"),
        ("/v1/chat/completions", '{"messages": [{"role": "tool"}]}', "messages.0", "tool message needs content"),
    ],
)
def test_bad_numbers_and_fields_are_a_400_naming_the_field(http, path, raw, param, message):
    error = error_of(http.post(path, content=raw, headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and re.search(message, error["message"]), error


def test_text_parts_are_joined_as_lines_everywhere(http):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                                        {"type": "text", "text": "Answer in one word."}]}]}
    joined = {"messages": [{"role": "user", "content": "Name a colour.\nAnswer in one word."}]}
    answers = [http.post("/v1/chat/completions", json=body | {"max_tokens": 6, "temperature": 0}).json()
               for body in (parts, joined)]
    assert answers[0]["usage"]["prompt_tokens"] == answers[1]["usage"]["prompt_tokens"]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]


# -- the API key: before anything else, on every route --------------------------------------------

def test_the_api_key_is_checked_first_on_every_route(server):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/generate"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"),
                         ("GET", "/metrics"), ("GET", "/health")]:
        # a body that does not validate: the key is checked first all the same
        response = httpx.request(method, server.url + path, content=b'{"prompt": 1', headers={
            "Content-Type": "application/json"})
        assert error_of(response, 401)["code"] == "invalid_api_key", path
    non_ascii = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sésame".encode()})
    assert error_of(non_ascii, 401)["code"] == "invalid_api_key"
    for path in ("/docs", "/openapi.json", "/metrics", "/health"):
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200, path


# -- the server's limits: each a 4xx naming the limit --------------------------------------------

def test_each_request_limit_is_a_4xx_naming_its_flag(http):
    too_big = http.post("/v1/completions", json=greedy("x" * 30_000))
    assert "--max-request-body-bytes" in error_of(too_big, 413)["message"]
    long_prompt = http.post("/v1/completions", json=greedy("word " * 1200))
    error = error_of(long_prompt, 400)
    assert error["param"] == "prompt" and "--max-prompt-chars" in error["message"], error
    many_stops = http.post("/v1/completions", json=greedy("Hi", stop=list("abcde")))
    error = error_of(many_stops, 400)
    assert error["param"] == "stop" and "--max-stop" in error["message"], error
    long_stop = http.post("/v1/chat/completions", json={"messages": HELLO, "stop": ["s" * 17]})
    error = error_of(long_stop, 400)
    assert error["param"] == "stop" and "--max-stop-chars" in error["message"], error


def test_a_request_past_the_time_limit_is_aborted_with_408_or_an_error_event(server, http):
    long = greedy("Tell me a long story.", max_tokens=4000)

    async def both() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            async def streamed() -> list[str]:
                async with client.stream("POST", "/v1/completions", json=long | {"stream": True}) as response:
                    return [line.removeprefix("data: ") async for line in response.aiter_lines()
                            if line.startswith("data: ")]

            return await asyncio.gather(client.post("/v1/completions", json=long), streamed())

    whole, events = asyncio.run(both())
    assert "--request-timeout" in error_of(whole, 408)["message"]
    assert events[-1] == "[DONE]" and "--request-timeout" in json.loads(events[-2])["error"]["message"]
    assert_idle_soon(server)


# -- a failing model step ends only its own request -------------------------------------------------

def test_a_failing_model_step_ends_only_the_request_that_fails_it(server, http):
    """Six greedy streams decode; then a request whose prompt makes the step raise joins them, with
    a top_k past the vocabulary and the largest seed with n = 2 (valid, once fatal to the batch)."""
    prompts = [f"Write a list of {i + 2} fruits:" for i in range(6)]
    solo = [http.post("/v1/completions", json=greedy(p, 16)) for p in prompts]
    assert [r.status_code for r in solo] == [200] * 6, solo[0].text
    alone = [r.json()["choices"][0]["text"] for r in solo]

    async def together() -> tuple[list[str], httpx.Response, list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            started = asyncio.Event()
            count = 0

            async def stream(prompt: str) -> str:
                nonlocal count
                text = ""
                async with client.stream("POST", "/v1/completions",
                                         json=greedy(prompt, 16, stream=True)) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                            count += 1
                            if count == len(prompts):
                                started.set()
                return text

            async def faulty() -> tuple[httpx.Response, list[str], httpx.Response]:
                await started.wait()
                whole = client.post("/v1/completions", json=greedy([FAULT_TOKEN, 1, 2], 4))
                odd = client.post("/v1/completions", json=greedy("Hi", 4, top_k=10**9, seed=2**64 - 1, n=2,
                                                                  temperature=1.0))
                async with client.stream("POST", "/v1/completions",
                                         json=greedy([3, FAULT_TOKEN], 4, stream=True)) as response:
                    events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
                return await whole, events, await odd

            *texts, (whole, events, odd) = await asyncio.gather(*map(stream, prompts), faulty())
            return texts, whole, events, odd

    texts, whole, events, odd = asyncio.run(together())
    assert texts == alone
    assert "injected fault" in error_of(whole, 500)["message"]
    assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]
    assert odd.status_code == 200 and [c["finish_reason"] for c in odd.json()["choices"]] == ["length"] * 2
    failed_steps = [int(n) for n in re.findall(r"a model step of (\d+) requests failed", server.output())]
    assert failed_steps and max(failed_steps) > 1  # the fault shared a step with its neighbours
    assert http.post("/v1/completions", json=greedy(prompts[0], 16)).json()["choices"][0]["text"] == alone[0]
    assert_idle_soon(server)


# -- the connection survives every error -------------------------------------------------------------

def test_errors_never_close_the_kept_alive_connection(server):
    connection = HTTPConnection("127.0.0.1", server.port, timeout=120)
    requests = [
        ("POST", "/v1/completions", json.dumps(greedy([FAULT_TOKEN], 2)), 500),
        ("POST", "/v1/completions", '{"prompt": ', 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": HELLO, "model": "gpt-4"}), 404),
        ("PUT", "/v1/completions", "{}", 405),
        ("GET", "/nowhere", "", 404),
        ("POST", "/v1/completions", json.dumps(greedy("Hi", 2, seed=2**64)), 400),
        ("POST", "/v1/completions", json.dumps(greedy("Hi", 2)), 200),
    ]
    connection.connect()
    first_socket = connection.sock
    for method, path, body, status in requests:
        connection.request(method, path, body=body, headers=AUTH | {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = json.loads(response.read())
        assert response.status == status, (path, payload)
        assert response.getheader("connection") != "close" and connection.sock is first_socket, path
        if status == 405:
            assert response.getheader("allow") == "POST" and payload["error"]["type"] == "invalid_request_error"
    connection.close()


def test_a_client_that_sends_its_body_byte_by_byte_delays_no_one(server, http):
    body = json.dumps(greedy("Name a fruit.", 4)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    half_sent = threading.Event()
    others_done = threading.Event()
    answer = bytearray()

    def slow_client() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
            sock.sendall(head)
            for index, byte in enumerate(body):
                sock.sendall(bytes([byte]))
                if index == len(body) // 2:
                    half_sent.set()
                    others_done.wait(timeout=120)  # the rest only once the others were answered
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer.extend(chunk)

    sender = threading.Thread(target=slow_client)
    sender.start()
    half_sent.wait(timeout=60)
    try:
        others = [http.post("/v1/completions", json=greedy(f"Count to {i}:", 4)) for i in (3, 4, 5)]
    finally:
        others_done.set()
        sender.join(timeout=120)
    assert [r.json()["usage"]["completion_tokens"] for r in others] == [4, 4, 4]
    status_line, _, rest = bytes(answer).partition(b"\r\n")
    assert status_line == b"HTTP/1.1 200 OK", answer
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 4


def test_disconnects_are_one_info_line_and_leave_nothing_behind(server, http):
    long = greedy("Tell me a long story.", max_tokens=2000)
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": HELLO, "max_tokens": 2000, "stream": True, "ignore_eos": True}) as response:
        lines = response.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=AUTH, json=long, timeout=1.5)
    # a client that goes away half-way through its body
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
    assert http.post("/v1/completions", json=greedy("Hi", 2)).status_code == 200  # after the disconnects
    assert_idle_soon(server)
    log = server.output()
    assert log.count("client went away; request aborted") + log.count("client disconnected; request aborted") >= 2
    for sign in UNHANDLED:
        assert sign not in log, sign


# -- the process: SIGKILL then restart, SIGTERM with streams in flight ------------------------------

def test_sigkill_then_restart_serves_again(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60,
                      json=greedy("Tell me a story.", 2000, stream=True)) as response:
        lines = response.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
        server.process.send_signal(signal.SIGKILL)
        assert server.process.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(httpx.HTTPError):
            list(lines)
    server.log.close()
    again = ServerProcess(*FLAGS, env=FAULT_ENV, port=server.port)  # the same port, at once
    server.__dict__.update(again.__dict__)  # the module's later tests use the new process
    answer = httpx.post(server.url + "/v1/completions", headers=AUTH, json=greedy("Hi", 3), timeout=60)
    assert answer.json()["usage"]["completion_tokens"] == 3


def test_sigterm_ends_streams_with_an_error_event_and_done_then_exits_0(server):
    """Streams still running SHUTDOWN_TIMEOUT seconds after SIGTERM end with an error event naming
    the shutdown and [DONE]; the process then exits 0 (bounded: within a minute)."""
    async def streams_then_sigterm() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            first_events = asyncio.Queue()

            async def stream(index: int) -> list[str]:
                path, body = (("/v1/chat/completions", {"messages": HELLO, "max_tokens": 4000, "ignore_eos": True,
                                                        "stream": True}) if index % 2 else
                              ("/v1/completions", greedy("Tell me a story.", 4000, stream=True)))
                events = []
                async with client.stream("POST", path, json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 1:
                                first_events.put_nowait(index)
                return events

            tasks = [asyncio.ensure_future(stream(i)) for i in range(3)]
            for _ in tasks:
                await first_events.get()
            server.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    for events in asyncio.run(streams_then_sigterm()):
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"] and "--shutdown-timeout" in error["message"], error
    assert server.process.wait(timeout=60) == 0
    log = server.output()
    assert "engine loop stopped" in log
    for sign in UNHANDLED:
        assert sign not in log, sign
