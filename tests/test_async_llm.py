"""AsyncLLM with its engine core in a thread and in a process of its own: the same greedy tokens as
LLM.generate, cancelling a consumer frees the request's blocks, an engine core that dies fails the
requests in flight; and the seed's OnlineScheduler / SchedulerManager over the same engine."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from support import EXACT

from roseinfer import (
    EngineConfig,
    InferenceEngine,
    OnlineScheduler,
    SamplingParams,
    SchedulerManager,
)
from roseinfer.engine.async_llm import AsyncLLM
from roseinfer.errors import EngineDeadError, EngineOverloadedError
from roseinfer.sampling_params import RequestOutputKind

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module", params=["thread", "process"])
def async_llm(request):
    engine = AsyncLLM(EngineConfig(kv_cache_memory=0.25, **EXACT), engine_core=request.param, max_queue_len=8)
    yield engine
    engine.shutdown()


async def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_outputs_equal_llm_generate(async_llm, default_llm):
    expected = [o.outputs[0].text for o in default_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]

    async def run() -> list[str]:
        async def one(index: int, prompt: str) -> str:
            pieces = []
            params = SamplingParams(temperature=0.0, max_tokens=12, output_kind=RequestOutputKind.DELTA)
            async for output in async_llm.generate(prompt, params, f"req-{index}"):
                pieces.append(output.outputs[0].text)
            return "".join(pieces)

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(run()) == expected


def test_cancelling_a_consumer_aborts_and_frees_blocks(async_llm):
    async def run() -> None:
        params = SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        received = asyncio.Event()

        async def consume() -> None:
            async for _ in async_llm.generate("Tell me a long story.", params, "long"):
                received.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(received.wait(), 60)
        assert async_llm.scheduler_stats.kv_cache_usage > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: async_llm.scheduler_stats.kv_cache_usage == 0
                         and async_llm.scheduler_stats.num_running == 0)
        assert not async_llm.output_processor.has_unfinished_requests()

    asyncio.run(run())


def test_admission_limit(async_llm):
    async def run() -> None:
        with pytest.raises(EngineOverloadedError, match="overloaded"):  # 9 sequences, the limit is 8
            await async_llm.add_request("a", "Hi", SamplingParams(max_tokens=3, n=9))
        assert not async_llm.output_processor.has_unfinished_requests()
        stream = await async_llm.add_request("b", "Hi", SamplingParams(max_tokens=3, n=8))
        outputs = [o async for o in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs) == 8

    asyncio.run(run())


def test_a_request_of_several_prompts_checks_its_grammar_once(async_llm, monkeypatch):
    import llguidance

    import roseinfer.structured_output_params as params_module
    from roseinfer.engine.async_llm import NewRequest
    from roseinfer.structured_output import StructuredOutputsParams

    checked = []

    class CountingMatcher:
        grammar_from_json_schema = staticmethod(llguidance.LLMatcher.grammar_from_json_schema)

        @staticmethod
        def validate_grammar(text):
            checked.append(text)
            return llguidance.LLMatcher.validate_grammar(text)

    class CountingLlguidance:
        LLMatcher = CountingMatcher

        def __getattr__(self, name):
            return getattr(llguidance, name)

    monkeypatch.setattr(params_module, "llguidance", CountingLlguidance())
    params = SamplingParams(max_tokens=2, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]+"))

    async def run() -> None:
        stream = await async_llm.add_requests([NewRequest(f"g{i}", prompt, params) for i, prompt in enumerate(PROMPTS)])
        outputs = [o async for o in stream]
        assert sum(o.finished for o in outputs) == len(PROMPTS)

    asyncio.run(run())
    assert len(checked) == 1  # three prompts, one HTTP request: one check (it was one per prompt)


def test_a_dead_engine_core_fails_requests_in_flight():
    engine = AsyncLLM(EngineConfig(kv_cache_memory=0.25), engine_core="process")

    async def run() -> None:
        params = SamplingParams(max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        stream = await engine.add_request("x", "Tell me a long story.", params)
        await anext(stream)
        os.kill(engine.core._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exit code -9"):
            async for _ in stream:
                pass
        assert not engine.alive
        with pytest.raises(EngineDeadError):
            await engine.add_request("y", "Hi", params)

    try:
        asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.shutdown()


def test_seed_online_scheduler_and_scheduler_manager(default_engine):
    expected = default_engine.generate("The capital of Italy is", max_new_tokens=8)

    # OnlineScheduler: requests from another thread, one engine thread stepping.
    online = OnlineScheduler(default_engine)
    texts: dict[int, str] = {}
    request_ids: list[int] = []

    def client() -> None:
        request_ids.append(online.add_request("The capital of Italy is", SamplingParams(temperature=0, max_tokens=8)))

    thread = threading.Thread(target=client)
    thread.start()
    thread.join()
    while online.wait_for_work(timeout=1):
        for delta in online.step():
            texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
    assert texts == {request_ids[0]: expected} and online.is_finished(request_ids[0])

    # SchedulerManager: the event-loop bridge, here over an engine built in its thread.
    tokenizer = default_engine.tokenizer
    manager = SchedulerManager(lambda: InferenceEngine(kv_cache_memory=0.25, **EXACT))

    async def run() -> str:
        request_id = manager.add(tokenizer.encode("The capital of Italy is"), SamplingParams(temperature=0, max_tokens=8))
        return "".join([delta.text async for delta in manager.stream(request_id)])

    try:
        assert manager.alive
        assert asyncio.run(run()) == expected
    finally:
        manager.stop()
    assert not manager.alive


def test_a_consumer_that_stops_taking_outputs_gets_its_request_aborted(async_llm, monkeypatch):
    """A stream's outputs queue up while its consumer is stuck (a client that reads nothing); past
    the bound the request is aborted, its slots freed, and the consumer hears why when it resumes."""
    import roseinfer.engine.async_llm as async_llm_module
    from roseinfer.errors import RequestTimeoutError

    monkeypatch.setattr(async_llm_module, "MAX_PENDING_OUTPUTS", 4)

    async def run() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        outputs = async_llm.generate("Once upon a time", params, "stuck-consumer")
        await outputs.__anext__()  # the first output; then the consumer stops taking them
        await wait_until(lambda: async_llm.num_running == 0 and async_llm.num_waiting == 0)
        with pytest.raises(RequestTimeoutError, match="never taken"):
            async for _ in outputs:
                pass

    asyncio.run(run())
