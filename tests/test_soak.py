"""A soak test of `roseinfer serve` with its default limits: three identical rounds of REQUESTS
requests, CONCURRENCY at a time, mixing chat and completions, streamed and whole, n = 1 and 2, a
tenth of the streams cut by the client part-way, and a few requests with bad input.

Every accepted request gets exactly one complete answer (a whole response with a finish reason for
every choice, or a stream with one finish reason per choice and one [DONE] at its end), bad input
gets a 400 and nothing gets a 5xx; after each round nothing is running or waiting and the KV cache
is empty; the server's memory outside its KV pool grows by less than MEMORY_GROWTH_BOUND from each round's end to
the next's (the first round warms allocators and caches up: about 60 MiB above the idle server).

Where the memory goes (2026-11-26, tests/soak_memory/rounds.py: this file's rounds against one
server): idle 442.7 MiB; after rounds 1-4 502.5, 504.7, 501.8, 501.5 MiB: it levels off after the
first round (a few MiB up or down, no trend). Live Python objects: 282,691 after round 1, 282,765
after round 5; tracemalloc's traced memory 133.4 MiB after rounds 1, 2 and 3 (+0.04 MiB in all).
glibc's malloc_trim(0) after each round (--trim) gives ~55 MiB back: 449.0, 449.1, 449.7, 449.7,
449.9 MiB: what a round allocates is freed, and glibc keeps the freed pages for the next round.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from live_server import ServerProcess, metric

REQUESTS = 192
CONCURRENCY = 64
CUT_ONE_STREAM_IN = 10
MEMORY_GROWTH_BOUND = 32 * 1024**2  # a round's growth of the RSS outside the KV pool (~0.5 GiB); seen: < 8 MiB
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write one sentence about the sea.",
             "What is 2 + 2?", "Give me a word that rhymes with cat.", "Who wrote Hamlet?"]
# Each is refused with a 400 naming the field; the raw bytes are not JSON that Python's json writes.
BAD_INPUTS: list[tuple[str, dict | bytes]] = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "tool"}]}),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "Hi", "stop": ["x" * 10_000]}),
]


@dataclass
class Planned:
    path: str
    body: dict | bytes
    stream: bool = False
    cut_after: int | None = None  # data events read before the client disconnects
    bad: bool = False


@dataclass
class Outcome:
    planned: Planned
    status: int
    problem: str | None = None  # what was wrong with a 200's answer


def plan_round(seed: int) -> list[Planned]:
    rng = random.Random(seed)
    plans: list[Planned] = []
    streams = 0
    for index in range(REQUESTS):
        if index % 53 == 7:
            path, body = BAD_INPUTS[(index // 53) % len(BAD_INPUTS)]
            plans.append(Planned(path, body, bad=True))
            continue
        chat, stream = index % 2 == 0, index % 4 in (1, 2)
        question = f"{QUESTIONS[index % len(QUESTIONS)]} (request {index})"
        body: dict = {"max_tokens": rng.randint(4, 12), "temperature": rng.choice([0.0, 0.8]),
                      "ignore_eos": rng.random() < 0.3, "stream": stream}
        if index % 11 == 0:  # unusual but valid: a top_k past the vocabulary, the largest seed with n = 2
            body |= {"top_k": 10**9, "seed": 2**64 - 1, "n": 2, "temperature": 1.0}
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": question}]
        else:
            path, body["prompt"] = "/v1/completions", question
        cut_after = None
        if stream:
            streams += 1
            if streams % CUT_ONE_STREAM_IN == 0:
                cut_after = rng.randint(1, 3)
        plans.append(Planned(path, body, stream, cut_after))
    return plans


def check_whole(body: dict, answer: dict) -> str | None:
    n = body.get("n", 1)
    choices = answer.get("choices", [])
    if sorted(c["index"] for c in choices) != list(range(n)):
        return f"choices {[c['index'] for c in choices]} for n={n}"
    if any(c["finish_reason"] not in ("stop", "length") for c in choices):
        return f"finish reasons {[c['finish_reason'] for c in choices]}"
    if not 1 <= answer["usage"]["completion_tokens"] <= n * body["max_tokens"]:
        return f"usage {answer['usage']}"
    return None


def check_stream(body: dict, events: list[str]) -> str | None:
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        return f"[DONE] {events.count('[DONE]')} times, last event {events[-1:]}"
    finishes: Counter[int] = Counter()
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            return f"error event {chunk}"
        for choice in chunk["choices"]:
            if choice.get("finish_reason") is not None:
                finishes[choice["index"]] += 1
    if finishes != Counter(range(body.get("n", 1))):
        return f"finish reasons per choice {dict(finishes)}"
    return None


async def send(http: httpx.AsyncClient, planned: Planned) -> Outcome:
    if isinstance(planned.body, bytes):
        response = await http.post(planned.path, content=planned.body, headers={"Content-Type": "application/json"})
        return Outcome(planned, response.status_code)
    if not planned.stream:
        response = await http.post(planned.path, json=planned.body)
        problem = check_whole(planned.body, response.json()) if response.status_code == 200 else None
        return Outcome(planned, response.status_code, problem)
    async with http.stream("POST", planned.path, json=planned.body) as response:
        if response.status_code != 200:
            await response.aread()
            return Outcome(planned, response.status_code)
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if planned.cut_after is not None and len(events) >= planned.cut_after:
                    return Outcome(planned, 200)  # leaving the block closes the connection
        return Outcome(planned, 200, check_stream(planned.body, events))


async def soak_round(url: str, plans: list[Planned]) -> list[Outcome]:
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def one(planned: Planned) -> Outcome:
            async with gate:
                return await send(http, planned)

        return await asyncio.gather(*(one(p) for p in plans))


def resident_bytes(pid: int) -> int:
    """The server's resident memory less its KV pool's: the pool (the mappings advised
    MADV_NOHUGEPAGE, flag `nh`) commits its pages as blocks are first used, up to its configured
    size, and prefix caching hands out never-used blocks before cached ones, so round 2 touches
    new blocks by design; what is left is what a leak would grow."""
    total = pool = 0
    rss = 0
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
                total += rss
            elif line.startswith("VmFlags:") and " nh" in line:
                pool += rss
    assert total > 0, "no Rss in smaps"
    return total - pool


def wait_until_idle(server: ServerProcess) -> None:
    """The requests cut by their clients are aborted as the server notices; bounded wait."""
    deadline = time.monotonic() + 60
    names = ("roseinfer:num_requests_running", "roseinfer:num_requests_waiting", "roseinfer:kv_cache_usage_perc")
    while any(metric(server, name) for name in names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {name: metric(server, name) for name in names} == dict.fromkeys(names, 0.0)


@pytest.fixture(scope="module")
def soak_server() -> Iterator[ServerProcess]:
    process = ServerProcess()  # the default limits, admission included
    yield process
    assert process.stop() == 0, process.output()


def test_three_soak_rounds_answer_everything_once_and_leave_nothing_behind(soak_server):
    plans = plan_round(seed=13)
    memory = []
    for round_number in (1, 2, 3):
        started = time.monotonic()
        outcomes = asyncio.run(soak_round(soak_server.url, plans))
        seconds = time.monotonic() - started
        wait_until_idle(soak_server)
        memory.append(resident_bytes(soak_server.process.pid))

        statuses = Counter(o.status for o in outcomes)
        assert all(o.status == 400 for o in outcomes if o.planned.bad), statuses
        assert all(o.status == 200 for o in outcomes if not o.planned.bad), statuses
        problems = [(o.planned.path, o.planned.body, o.problem) for o in outcomes if o.problem]
        assert not problems, problems[:5]
        cut = sum(o.planned.cut_after is not None for o in outcomes)
        print(f"soak round {round_number}: {len(outcomes)} requests, {CONCURRENCY} at a time, {seconds:.1f} s; "
              f"{statuses[200] - cut} complete answers, {cut} streams cut by the client, {statuses[400]} bad "
              f"inputs refused; server RSS {memory[-1] / 1024**2:.0f} MiB")
    growth = [memory[i + 1] - memory[i] for i in range(len(memory) - 1)]
    print(f"soak: RSS growth in rounds 2 and 3: {', '.join(f'{g / 1024**2:+.1f}' for g in growth)} MiB "
          f"(bound {MEMORY_GROWTH_BOUND / 1024**2:.0f} MiB a round)")
    assert all(g < MEMORY_GROWTH_BOUND for g in growth), growth
    log = soak_server.output()
    for bad_sign in ("Exception in ASGI application", "Task exception was never retrieved", "Traceback"):
        assert bad_sign not in log, bad_sign
