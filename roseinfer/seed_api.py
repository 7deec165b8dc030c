"""The seed project's names, kept working with their signatures as thin adapters on top of the
public `LLM` / `LLMEngine` API (which know nothing of them):

    InferenceEngine    the seed's engine: `generate`, `stream_generate`, `add_request`, `step`,
                       over an `LLMEngine`, with read-only views of its parts; `LLM.engine` is one,
                       attached to `LLM` here (see install_llm_view)
    InferenceSession   a request's state in the engine core (`roseinfer.core.request.Request`)
    OfflineScheduler   the seed's batch API: `add_request`, `step`, `has_unfinished`, `run`
    OnlineScheduler    an engine fed from other threads while one thread steps it
    SchedulerManager   the seed's event-loop bridge: AsyncLLM's, over an engine the seed builds

The seed's sampling arguments (`max_new_tokens`, `temperature`, `top_k`, `top_p`, `stop_on_eos`,
`do_sample`, `seed`) become a `SamplingParams` in one place, `SamplingParams.from_seed_args`; the
methods here pass them through as given. Request ids are ints here, as the seed had them; deltas
are `OutputDelta`s.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from roseinfer.config import EngineConfig
from roseinfer.core.request import Request
from roseinfer.engine.async_llm import AsyncLLM, RequestOutputStream
from roseinfer.engine.input_processor import ProcessedRequest, PromptType
from roseinfer.engine.llm import LLM
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.stats import LoggingStatLogger
from roseinfer.outputs import RequestOutput, TokenLogprob
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


def _deltas(outputs: Sequence[RequestOutput]) -> list[OutputDelta]:
    return [
        OutputDelta(int(output.request_id), c.index, c.token_ids, c.text, c.finished, c.finish_reason,
                    c.stop_reason, c.logprobs, c.error)
        for output in outputs for c in output.outputs
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
        return self.llm_engine.scheduler

    @property
    def kv_cache(self):
        return self.llm_engine.kv_cache

    @property
    def runner(self):
        return self.llm_engine.model_runner

    @property
    def model(self):
        return self.llm_engine.model_runner.model

    @property
    def timings(self):
        return self.llm_engine.timings

    # -- requests -------------------------------------------------------------------------
    def process(
        self,
        prompt: PromptType | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        add_special_tokens: bool = True,
    ) -> ProcessedRequest:
        """Check and tokenize a request under a fresh id (raises InvalidRequestError); nothing is queued."""
        return self.llm_engine.input_processor.process(
            self.llm_engine.new_request_id(), prompt_token_ids if prompt_token_ids is not None else prompt,
            _delta_params(sampling_params), add_special_tokens=add_special_tokens,
        )

    def add_request(self, *args: Any, **kwargs: Any) -> int:
        """Queue a request (text, token ids or a ChatPrompt; `process`'s arguments); returns its id.
        `step` gives its deltas."""
        processed = self.process(*args, **kwargs)
        self.llm_engine.add_processed_request(processed)
        return int(processed.request_id)

    def abort_request(self, request_id: int) -> None:
        self.llm_engine.abort_request(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def step(self) -> list[OutputDelta]:
        """One engine step; the deltas of the requests it touched."""
        return _deltas(self.llm_engine.step())

    # -- the seed's convenience API -------------------------------------------------------
    def generate(self, prompt: PromptType, *seed_args: Any, **seed_kwargs: Any) -> str:
        """The whole text of one request; the seed's sampling arguments as `from_seed_args` takes
        them (`max_new_tokens=64`, greedy unless `do_sample`, ...)."""
        return "".join(self.stream_generate(prompt, *seed_args, **seed_kwargs))

    def stream_generate(self, prompt: PromptType, *seed_args: Any, **seed_kwargs: Any) -> Iterator[str]:
        """`generate`'s text in pieces as they are generated."""
        return self.stream(prompt, SamplingParams.from_seed_args(*seed_args, **seed_kwargs))

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text pieces of one request as they are generated (other queued requests run too);
        leaving early aborts it."""
        request_id = self.add_request(prompt, sampling_params)
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

    def add_request(self, prompt: str, *seed_args: Any, add_special_tokens: bool = True, **seed_kwargs: Any) -> int:
        """Queue a prompt with the seed's sampling arguments (as `SamplingParams.from_seed_args`)."""
        params = SamplingParams.from_seed_args(*seed_args, **seed_kwargs)
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

    def add_request(self, *args: Any, **kwargs: Any) -> int:
        """Check and queue a request (InferenceEngine.process's arguments); returns its id (raises
        InvalidRequestError on bad input)."""
        processed = self.engine.process(*args, **kwargs)
        with self._work:
            self._inbox.append(processed)
            self._live.add(int(processed.request_id))
            self._work.notify()
        return int(processed.request_id)

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
        llm_engine.abort_request([str(request_id) for request_id in aborts])
        outputs = llm_engine.step() if llm_engine.has_unfinished_requests() else []
        # A request is done when its output says so (with n > 1: all of its sequences).
        done = {int(output.request_id) for output in outputs if output.finished} | aborts
        with self._lock:
            self._live -= done
        return _deltas(outputs)


class SchedulerManager:
    """The seed's bridge between an event loop and an engine thread, over AsyncLLM's (the one
    bridge): `engine` is an InferenceEngine, or a factory of one that runs in the engine thread
    (PyTorch's thread pools belong to the thread that loads the model). `add` queues token ids
    (from the event loop); `stream` yields the request's OutputDeltas; leaving it early aborts the
    request. `max_queue_len` bounds the sequences waiting (EngineOverloadedError beyond it); a
    throughput line is logged every `stats_interval` seconds."""

    def __init__(
        self,
        engine: InferenceEngine | Callable[[], InferenceEngine],
        max_queue_len: int | None = None,
        stats_interval: float = 10.0,
    ) -> None:
        factory = engine if callable(engine) and not isinstance(engine, InferenceEngine) else (lambda: engine)
        self.async_llm = AsyncLLM(
            None, max_queue_len=max_queue_len, stat_loggers=[LoggingStatLogger(stats_interval)],
            make_engine_core=lambda: factory().engine_core,
        )
        self._request_ids = itertools.count()
        self._streams: dict[int, RequestOutputStream] = {}

    @property
    def dead_reason(self) -> str | None:
        return self.async_llm.dead_reason

    @property
    def alive(self) -> bool:
        return self.async_llm.alive

    @property
    def num_waiting(self) -> int:
        """Sequences accepted here and not yet running."""
        return self.async_llm.num_waiting

    def start(self) -> None:
        """Kept for the seed's callers: the engine thread runs from the start, and `add` attaches
        to the caller's event loop."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; streams still open end with EngineDeadError."""
        self.async_llm.shutdown(timeout)

    def add(self, token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None) -> int:
        """Queue a request from the event loop (raises InvalidRequestError, EngineOverloadedError,
        EngineDeadError); read its deltas with `stream`. `prompt`, the text of `token_ids` that
        the seed's callers passed along, is not needed: the ids are what runs."""
        request_id = next(self._request_ids)
        processed = self.async_llm.input_processor.process(str(request_id), list(token_ids), _delta_params(params))
        self._streams[request_id] = self.async_llm.add_processed_requests([processed])
        return request_id

    async def stream(self, request_id: int) -> AsyncIterator[OutputDelta]:
        """The request's deltas until its last one; leaving early aborts the request."""
        stream = self._streams[request_id]
        try:
            async for output in stream:
                for delta in _deltas([output]):
                    yield delta
        finally:
            self._streams.pop(request_id, None)
            stream.close()

    def abort(self, request_id: int) -> None:
        """End a request (its stream ends after a last delta with finish_reason "abort");
        unknown or finished ids are ignored."""
        self.async_llm.abort_request(str(request_id))


def install_llm_view() -> None:
    """`LLM.engine`: the seed's InferenceEngine over the LLM's engine (made on first use), which the
    seed's callers and tests reach. Attached from here, above `LLM`, so that LLM imports nothing of
    the seed; the package's face (roseinfer/__init__.py) runs this whenever it hands out `LLM`."""
    if "engine" in vars(LLM):
        return

    def engine(llm: LLM) -> InferenceEngine:
        view = llm.__dict__.get("_seed_engine")
        if view is None:
            view = llm.__dict__["_seed_engine"] = InferenceEngine(llm_engine=llm.llm_engine)
        return view

    LLM.engine = property(engine, doc=install_llm_view.__doc__)


install_llm_view()
