"""The seed project's names, kept working with their signatures as thin adapters over the engine:

    InferenceEngine    the seed's engine: `generate`, `stream_generate`, `add_request`, `step`,
                       over an `LLMEngine` (also `LLM.engine`), with read-only views of its parts
    InferenceSession   a request's state in the engine core (`roseinfer.request.Request`)
    OfflineScheduler   the seed's batch API: `add_request`, `step`, `has_unfinished`, `run`
    OnlineScheduler    an engine fed from other threads while one thread steps it
    SchedulerManager   the event-loop bridge the seed's server used; now an `AsyncLLM` underneath

Request ids are ints here, as the seed had them; deltas are `OutputDelta`s.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.input_processor import ProcessedRequest
from roseinfer.outputs import RequestOutput, TokenLogprob
from roseinfer.request import Request
from roseinfer.sampling_params import RequestOutputKind, SamplingParams

InferenceSession = Request


@dataclass
class OutputDelta:
    """What one engine step produced for one sequence: new tokens and the text they completed."""

    request_id: int
    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


def _deltas(output: RequestOutput) -> list[OutputDelta]:
    return [
        OutputDelta(int(output.request_id), c.index, c.token_ids, c.text, c.finished, c.finish_reason,
                    c.stop_reason, c.logprobs, c.error)
        for c in output.outputs
    ]


def _delta_params(params: SamplingParams | None) -> SamplingParams:
    return replace(params or SamplingParams(), output_kind=RequestOutputKind.DELTA)


class InferenceEngine:
    """`InferenceEngine(model=None, **engine_args)`; the seed's spelling
    `InferenceEngine(checkpoint_path=..., tokenizer_name=..., device=...)` works too."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        checkpoint_path: str | None = None,
        tokenizer_name: str | None = None,
        llm_engine: LLMEngine | None = None,
        **engine_args: Any,
    ) -> None:
        if llm_engine is None:
            if config is None:
                if checkpoint_path is not None:
                    model = checkpoint_path
                if tokenizer_name is not None:
                    engine_args["tokenizer"] = tokenizer_name
                config = EngineConfig.from_kwargs(model=model, **engine_args)
            llm_engine = LLMEngine(config)
        self.llm_engine = llm_engine
        self.config = llm_engine.config
        self.tokenizer = llm_engine.tokenizer
        self.model_config = llm_engine.model_config
        self.model_name = llm_engine.model_name
        self.max_model_len = llm_engine.max_model_len
        self.device = self.config.torch_device
        self.dtype = self.config.torch_dtype

    # Views of the engine's parts (in this process), for tests, benchmarks and debugging.
    @property
    def engine_core(self):
        return self.llm_engine.engine_core

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def kv_cache(self):
        return self.engine_core.kv_cache

    @property
    def runner(self):
        return self.engine_core.executor.model_runner

    @property
    def model(self):
        return self.runner.model

    @property
    def timings(self):
        return self.llm_engine.timings

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        add_special_tokens: bool = True,
    ) -> int:
        """Queue a request (text or token ids); returns its id. `step` gives its deltas."""
        request_id = self.llm_engine.new_request_id()
        self.llm_engine.add_request(
            request_id, prompt_token_ids if prompt_token_ids is not None else prompt,
            _delta_params(sampling_params), add_special_tokens=add_special_tokens,
        )
        return int(request_id)

    def abort_request(self, request_id: int) -> None:
        self.llm_engine.abort_request(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def step(self) -> list[OutputDelta]:
        """One engine step; the deltas of the requests added through this API."""
        return [delta for output in self.llm_engine.step() for delta in _deltas(output)]

    # -- the seed's convenience API -------------------------------------------------------
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_on_eos: bool = True,
        do_sample: bool = False,
        seed: int | None = None,
    ) -> str:
        return "".join(
            self.stream_generate(prompt, max_new_tokens, temperature, top_k, top_p, stop_on_eos, do_sample, seed)
        )

    def stream_generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_on_eos: bool = True,
        do_sample: bool = False,
        seed: int | None = None,
    ) -> Iterator[str]:
        """Yields text pieces of one request as they are generated (other queued requests run too)."""
        params = SamplingParams.from_seed_args(max_new_tokens, temperature, top_k, top_p, stop_on_eos, do_sample, seed)
        request_id = self.add_request(prompt, params)
        try:
            while True:
                for delta in self.step():
                    if delta.request_id != request_id:
                        continue
                    if delta.error:
                        raise RuntimeError(f"generation failed: {delta.error}")
                    if delta.text:
                        yield delta.text
                    if delta.finished:
                        return
        finally:
            self.abort_request(request_id)


class OfflineScheduler:
    """The seed's batch API: add requests (also between steps), step, run to completion."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._texts: dict[int, list[str]] = {}
        self._tokens: dict[int, list[int]] = {}
        self._finished: set[int] = set()

    def add_request(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_on_eos: bool = True,
        do_sample: bool = False,
        seed: int | None = None,
        add_special_tokens: bool = True,
    ) -> int:
        params = SamplingParams.from_seed_args(max_new_tokens, temperature, top_k, top_p, stop_on_eos, do_sample, seed)
        request_id = self.engine.add_request(prompt, params, add_special_tokens=add_special_tokens)
        self._texts[request_id] = []
        self._tokens[request_id] = []
        return request_id

    def step(self) -> dict[int, int]:
        """One engine step; returns {request id: token generated this step} for this scheduler's requests."""
        produced: dict[int, int] = {}
        for delta in self.engine.step():
            if delta.request_id not in self._texts:
                continue
            self._texts[delta.request_id].append(delta.text)
            self._tokens[delta.request_id].extend(delta.token_ids)
            if delta.token_ids:
                produced[delta.request_id] = delta.token_ids[-1]
            if delta.finished:
                self._finished.add(delta.request_id)
        return produced

    def has_unfinished(self) -> bool:
        return len(self._finished) < len(self._texts)

    def is_finished(self, request_id: int) -> bool:
        return request_id in self._finished

    def text(self, request_id: int) -> str:
        return "".join(self._texts[request_id])

    def token_ids(self, request_id: int) -> list[int]:
        return list(self._tokens[request_id])

    def run(self) -> dict[int, str]:
        """Step until every request added here is done; returns {request id: generated text}."""
        while self.has_unfinished():
            self.step()
        return {request_id: self.text(request_id) for request_id in self._texts}


class OnlineScheduler:
    """An engine fed from any thread while one thread steps it: `add_request` and `abort` check
    and tokenize in the caller's thread and return at once; `step` (the engine thread's) admits
    them before running the next batch."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified when there is something to step
        self._inbox: deque[ProcessedRequest] = deque()
        self._aborts: set[int] = set()
        self._live: set[int] = set()  # accepted and not finished

    def add_request(
        self,
        prompt: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        add_special_tokens: bool = True,
    ) -> int:
        """Check and queue a request; returns its id (raises InvalidRequestError on bad input)."""
        llm_engine = self.engine.llm_engine
        request_id = llm_engine.new_request_id()
        processed = llm_engine.input_processor.process(
            request_id, prompt_token_ids if prompt_token_ids is not None else prompt,
            _delta_params(sampling_params), add_special_tokens=add_special_tokens,
        )
        with self._work:
            self._inbox.append(processed)
            self._live.add(int(request_id))
            self._work.notify()
        return int(request_id)

    def abort(self, request_id: int) -> None:
        """End a request at the next step and free its blocks; unknown ids are ignored."""
        with self._work:
            if request_id in self._live:
                self._aborts.add(request_id)
                self._work.notify()

    def is_finished(self, request_id: int) -> bool:
        with self._lock:
            return request_id not in self._live

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    def wake(self) -> None:
        with self._work:
            self._work.notify_all()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request is queued or running (or `timeout`); True if there is work."""
        with self._work:
            return self._work.wait_for(lambda: self._live, timeout)

    def step(self) -> list[OutputDelta]:
        """Admit queued requests, apply aborts, run one engine step. Engine thread only."""
        with self._lock:
            inbox, self._inbox = self._inbox, deque()
            aborts, self._aborts = self._aborts, set()
        llm_engine = self.engine.llm_engine
        for processed in inbox:
            if int(processed.request_id) not in aborts:
                llm_engine.add_processed_request(processed)
        for request_id in aborts:
            llm_engine.abort_request(str(request_id))
        deltas = self.engine.step() if llm_engine.has_unfinished_requests() else []
        parents = llm_engine.output_processor.parents
        done = {d.request_id for d in deltas if d.finished and str(d.request_id) not in parents} | aborts
        with self._lock:
            self._live -= done
        return deltas


class SchedulerManager:
    """The seed's bridge between an event loop and an engine thread, now an `AsyncLLM` whose
    engine core runs in that thread (built there by `engine`, an InferenceEngine factory).
    `add` queues token ids; `stream` yields the request's OutputDeltas; leaving it aborts."""

    def __init__(
        self,
        engine: InferenceEngine | Callable[[], InferenceEngine],
        max_queue_len: int | None = None,
        stats_interval: float = 10.0,
    ) -> None:
        from roseinfer.engine.async_llm import AsyncLLM
        from roseinfer.engine.stats import LoggingStatLogger

        factory = engine if callable(engine) and not isinstance(engine, InferenceEngine) else (lambda: engine)
        self.async_llm = AsyncLLM.over_llm_engine(
            lambda: factory().llm_engine, max_queue_len=max_queue_len,
            stat_loggers=[LoggingStatLogger(stats_interval)],
        )
        self._ids = itertools.count()
        self._streams: dict[int, Any] = {}

    @property
    def alive(self) -> bool:
        return self.async_llm.alive

    def start(self) -> None:
        """Attach to the running event loop (kept for the seed's callers; nothing else to do)."""

    def stop(self, timeout: float = 10.0) -> None:
        self.async_llm.shutdown(timeout)

    def add(self, token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None) -> int:
        """Queue a request from the event loop (raises InvalidRequestError, EngineOverloadedError);
        read its deltas with `stream`."""
        request_id = next(self._ids)
        processed = self.async_llm.input_processor.process(str(request_id), list(token_ids), _delta_params(params))
        self._streams[request_id] = self.async_llm.add_processed_requests([processed])
        return request_id

    async def stream(self, request_id: int) -> AsyncIterator[OutputDelta]:
        """The request's deltas until its last one; leaving early aborts the request."""
        stream = self._streams.pop(request_id)
        try:
            async for output in stream:
                for delta in _deltas(output):
                    yield delta
        finally:
            stream.close()

    def abort(self, request_id: int) -> None:
        self.async_llm.abort_request(str(request_id))
