"""The asyncio engine under the HTTP server: `await add_request(...)` checks and queues a request
and returns its stream of `RequestOutput`s (a `PoolingRequestOutput` for an embedding request, whose
params are `PoolingParams`); closing or cancelling the stream aborts the request.

The engine core runs beside the event loop, in a background thread or in a process of its own
(`engine_core="thread" | "process"`, see core/core_client.py). Tokenizing runs in a worker thread,
detokenizing on the event loop as outputs arrive; nothing on the event loop waits for a step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from roseinfer.common.messages import EngineCoreOutputs, SchedulerStats
from roseinfer.config import EngineConfig
from roseinfer.core.core_client import (
    EngineCoreClient,
    ProcessEngineCoreClient,
    ThreadedEngineCoreClient,
)
from roseinfer.core.engine_core import EngineCore
from roseinfer.engine.front_end import EngineFrontEnd
from roseinfer.engine.input_processor import ProcessedRequest, PromptType
from roseinfer.engine.stats import StatLogger
from roseinfer.errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestTimeoutError,
    RoseInferError,
)
from roseinfer.outputs import PoolingRequestOutput, RequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

logger = logging.getLogger("roseinfer")

ENGINE_CORE_MODES = ("thread", "process")


@dataclass
class NewRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding of the prompt
    add_special_tokens: bool = True
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only within one salt
    # A max_tokens beyond what fits after the prompt is cut to fit (an API whose cap is an upper
    # bound: Messages, Responses), not a 400 (OpenAI's chat and completions).
    fit_max_tokens: bool = False


Output = RequestOutput | PoolingRequestOutput

# Outputs (one a step per request) waiting for their consumer before the request is aborted.
MAX_PENDING_OUTPUTS = 4096


class RequestOutputStream:
    """The outputs of one or several requests as they arrive: `async for output in stream` (each
    output's `request_id` says whose). Ends once every request has finished; raises
    EngineDeadError if the engine stops first, RequestTimeoutError (after aborting the requests)
    if they have not finished by `timeout` seconds after `arrival`. `close()` aborts the requests
    that have not finished (AsyncLLM.generate does so when the consuming task is cancelled or
    leaves early)."""

    def __init__(
        self, engine: AsyncLLM, request_ids: list[str], arrival: float | None = None, timeout: float | None = None
    ) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue[Output | BaseException] = asyncio.Queue()
        self._overflowed = False
        self._timeout = timeout
        self._deadline = None if timeout is None else (time.monotonic() if arrival is None else arrival) + timeout

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def put(self, item: Output | BaseException) -> None:
        if self._overflowed:
            return  # aborted: the outputs still on their way are dropped
        if not isinstance(item, BaseException) and self._queue.qsize() >= MAX_PENDING_OUTPUTS:
            # Its consumer has stopped taking outputs (a stream whose client reads nothing, with
            # --send-timeout 0): abort rather than hold an ever-growing queue.
            self._overflowed = True
            self.close()
            self._queue = asyncio.Queue()
            self._queue.put_nowait(RequestTimeoutError(
                f"the request's {MAX_PENDING_OUTPUTS} newest outputs were never taken (the client stopped "
                "reading); it was aborted"))
            return
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestOutputStream:
        return self

    async def __anext__(self) -> Output:
        if not self._unfinished and self._queue.empty():
            raise StopAsyncIteration
        if self._deadline is None:
            item = await self._queue.get()
        else:
            try:
                item = await asyncio.wait_for(self._queue.get(), max(self._deadline - time.monotonic(), 0.0))
            except TimeoutError:
                self.close()
                raise RequestTimeoutError(
                    f"the request did not finish within this server's time limit of {self._timeout:g} s "
                    "per request (--request-timeout); it was aborted"
                ) from None
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def close(self) -> None:
        unfinished, self._unfinished = self._unfinished, set()
        for request_id in unfinished:
            self._engine.abort_request(request_id)


class AsyncLLM(EngineFrontEnd):
    def __init__(
        self,
        config: EngineConfig | None,
        *,
        engine_core: str = "thread",
        max_queue_len: int | None = None,
        request_timeout: float | None = None,
        stat_loggers: Sequence[StatLogger] = (),
        make_engine_core: Callable[[], EngineCore] | None = None,
    ) -> None:
        """`make_engine_core` (thread mode only; `config` None): an engine core built by the
        caller's factory in the engine thread (the seed's SchedulerManager runs its engine so),
        whose configuration this front end then takes."""
        if engine_core not in ENGINE_CORE_MODES:
            raise ValueError(f"engine_core must be one of {ENGINE_CORE_MODES}, got {engine_core!r}")
        if (make_engine_core is None) == (config is None) or (make_engine_core and engine_core != "thread"):
            raise ValueError("give AsyncLLM a config, or (in thread mode) a factory of its engine core")
        started = time.perf_counter()
        self._streams: dict[str, RequestOutputStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_reason: str | None = None
        self.core: EngineCoreClient
        if make_engine_core is not None:
            self.core = ThreadedEngineCoreClient(make_engine_core, self._deliver, self._engine_died)
            config = self.core.engine_core.config
        super().__init__(config)
        self.max_queue_len = max_queue_len
        self.stat_loggers = list(stat_loggers)
        self.scheduler_stats = SchedulerStats()  # the latest snapshot from the engine core
        self.request_timeout = request_timeout  # seconds from arrival to the last output
        self.refusing: str | None = None  # why new requests are refused (shutting down), or None
        if make_engine_core is not None:
            pass  # started above, before the front end needed its configuration
        elif engine_core == "process":
            self.core = ProcessEngineCoreClient(
                config, self.model_config, self._deliver, self._engine_died
            )
        else:
            model_config = self.model_config
            self.core = ThreadedEngineCoreClient(
                lambda: EngineCore(config, model_config), self._deliver, self._engine_died
            )
        self.engine_core_mode = engine_core
        self.log_ready(time.perf_counter() - started)

    # -- state ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.core.alive

    @property
    def num_waiting(self) -> int:
        """Sequences accepted and not yet running (queued here or in the engine core)."""
        return max(self.output_processor.num_unfinished_sequences - self.scheduler_stats.num_running, 0)

    @property
    def num_running(self) -> int:
        return self.scheduler_stats.num_running

    # -- requests -------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, *,
        add_special_tokens: bool = True
    ) -> RequestOutputStream:
        """Check, tokenize (in a worker thread) and queue one request; raises InvalidRequestError,
        EngineOverloadedError or EngineDeadError before anything is queued."""
        return await self.add_requests([NewRequest(request_id, prompt, params, add_special_tokens)])

    async def add_requests(self, requests: Sequence[NewRequest]) -> RequestOutputStream:
        """Several requests checked together (either all are queued or none is), with one stream."""
        self._check_accepting()
        # The queue's room first, from the request's own numbers (prompts x n): a request the
        # limit refuses costs no tokenizing and no grammar check.
        self._check_room(sum(r.params.n for r in requests))
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise ValueError(f"request ids must be unique, got {ids}")
        self._loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        processed = await self._loop.run_in_executor(None, self._process_all, requests, arrival)
        return self.add_processed_requests(processed)

    def _check_accepting(self) -> None:
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self.dead_reason or 'stopped'})")
        if self.refusing is not None:
            raise EngineOverloadedError(self.refusing)

    def _check_room(self, wanted: int) -> None:
        """EngineOverloadedError when `wanted` more sequences would not fit in the queue's limit."""
        if self.max_queue_len is not None and self.num_waiting + wanted > self.max_queue_len:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.num_waiting} requests are waiting "
                f"(limit {self.max_queue_len}); retry later"
            )

    def add_processed_requests(self, processed: Sequence[ProcessedRequest]) -> RequestOutputStream:
        """Queue requests the input processor has checked (from the event loop's thread)."""
        self._loop = asyncio.get_running_loop()
        self._check_accepting()
        self._check_room(sum(len(p.core_requests) for p in processed))
        arrival = min((request.arrival_time for request in processed), default=None)
        stream = RequestOutputStream(self, [request.request_id for request in processed], arrival,
                                     self.request_timeout)
        core_requests = []
        for request in processed:
            core_requests.extend(self.register_request(request))
            self._streams[request.request_id] = stream
        self.core.add_requests(core_requests)
        return stream

    def _process_all(self, requests: Sequence[NewRequest], arrival: float) -> list[ProcessedRequest]:
        # One grammar check per HTTP request (its prompts share one constraint), before any tokenizing.
        constraints = [r.params.structured_outputs for r in requests if isinstance(r.params, SamplingParams)]
        for constraint in {id(c): c for c in constraints if c is not None}.values():
            constraint.validate()
        return [
            self.input_processor.process(
                r.request_id, r.prompt, r.params, add_special_tokens=r.add_special_tokens,
                strict_max_tokens=not r.fit_max_tokens, arrival_time=arrival, cache_salt=r.cache_salt,
            )
            for r in requests
        ]

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, *, add_special_tokens: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's spelling: the request's outputs (by `params.output_kind`) until it finishes;
        leaving the loop early or cancelling aborts it."""
        stream = await self.add_request(request_id, prompt, params, add_special_tokens=add_special_tokens)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort_request(self, request_id: str) -> None:
        """End a request now and free its blocks; its stream gets a last output with finish_reason
        "abort". Unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        sequence_ids, last_output = self.output_processor.abort_request(request_id)
        if stream is not None and last_output is not None:
            stream.put(last_output)
        if sequence_ids and self.alive:
            self.core.abort_requests(sequence_ids)

    async def abort(self, request_id: str) -> None:
        self.abort_request(request_id)

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    # -- outputs (the engine's thread, then the event loop) ----------------------------------
    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._process_outputs, outputs)

    def _process_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        if core_outputs.scheduler_stats is not None:
            self.scheduler_stats = core_outputs.scheduler_stats
        processed = self.output_processor.process_outputs(core_outputs)
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]
        if processed.reqs_to_abort and self.alive:
            self.core.abort_requests(processed.reqs_to_abort)
        for stat_logger in self.stat_loggers:
            stat_logger.record(core_outputs.scheduler_stats, processed.iteration_stats)

    def _engine_died(self, reason: str) -> None:
        """From the client's thread: the engine core stopped unasked."""
        logger.error("engine core died: %s", reason)
        self.dead_reason = reason
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        for request_id in list(self._streams):
            self.output_processor.abort_request(request_id)  # the engine that would run them is gone
        for stream in set(self._streams.values()):
            stream.put(EngineDeadError(f"the engine stopped: {reason}"))
        self._streams.clear()

    def refuse_new_requests(self, reason: str) -> None:
        """From now on add_request raises EngineOverloadedError(reason) (a server shutting down)."""
        self.refusing = reason

    def end_all_requests(self, error: RoseInferError) -> None:
        """End every request in flight now: abort it in the engine core and raise `error` in its
        stream (a server that shuts down tells its clients so)."""
        aborted: list[str] = []
        for request_id in list(self._streams):
            sequence_ids, _ = self.output_processor.abort_request(request_id)
            aborted.extend(sequence_ids)
        for stream in set(self._streams.values()):
            stream.put(error)
        self._streams.clear()
        if aborted and self.alive:
            self.core.abort_requests(aborted)

    # -- life cycle -----------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core; requests still in flight end with EngineDeadError."""
        if self.dead_reason is None:
            self.dead_reason = "shut down"
        self.core.shutdown(timeout)
        if self._loop is not None and not self._loop.is_closed() and self._streams:
            self._loop.call_soon_threadsafe(self._fail_all, "shut down")
