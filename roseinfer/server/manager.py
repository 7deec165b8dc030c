"""The seed's `SchedulerManager`: the bridge between the server's event loop and the engine thread.

The engine loop runs in a thread of its own and sleeps on the OnlineScheduler's condition while
there is nothing to do. Each request gets an asyncio queue; the deltas of a step are handed to the
event loop in one `call_soon_threadsafe`, so the loop never waits for the engine. A consumer that
goes away (client disconnected, request cancelled) aborts its request: the engine drops it and
frees its blocks before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from roseinfer.engine import InferenceEngine
from roseinfer.online import OnlineScheduler
from roseinfer.outputs import OutputDelta
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.metrics import ServerMetrics

logger = logging.getLogger("roseinfer.server")


class QueueFullError(Exception):
    """More requests are waiting than --max-queue-len allows."""


@dataclass
class _Tracked:
    queue: asyncio.Queue
    arrival: float
    last_token: dict[int, float] = field(default_factory=dict)  # sequence index -> time


class SchedulerManager:
    def __init__(
        self,
        engine: InferenceEngine | Callable[[], InferenceEngine],
        max_queue_len: int | None = None,
        stats_interval: float = 10.0,
    ) -> None:
        """Starts the engine thread. Given a factory, the engine is built in that thread: PyTorch's
        OpenMP pools are per calling thread, and with a second pool on a machine this small its
        worker threads sleep between ops instead of spinning, which made every step ~30% slower
        when the model was loaded in the main thread and run in another."""
        self.max_queue_len = max_queue_len
        self.stats_interval = stats_interval
        self._tracked: dict[int, _Tracked] = {}  # touched by the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        factory = engine if callable(engine) and not isinstance(engine, InferenceEngine) else (lambda: engine)
        self._thread = threading.Thread(target=self._run, args=(factory,), name="roseinfer-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        engine = self.engine
        self.metrics = ServerMetrics(engine.model_name, {
            "running": lambda: engine.scheduler.num_running,
            "waiting": lambda: self.scheduler.num_queued,
            "kv_usage": lambda: engine.kv_cache.usage,
            "max_batch": lambda: engine.scheduler.stats.max_batch_requests,
        }, totals={
            "preemptions": lambda: engine.scheduler.stats.num_preemptions,
            "prefix_queries": lambda: engine.kv_cache.prefix_stats.queries,
            "prefix_hits": lambda: engine.kv_cache.prefix_stats.hits,
        })

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Attach to the running event loop, where deltas are delivered."""
        self._loop = asyncio.get_running_loop()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running and stop the engine thread."""
        self._stopping = True
        for request_id in list(self._tracked):
            self.scheduler.abort(request_id)
        self.scheduler.wake()
        self._thread.join(timeout)

    # -- requests (event loop) ------------------------------------------------------------
    def check_capacity(self, new_requests: int = 1) -> None:
        if self.max_queue_len is not None and self.scheduler.num_queued + new_requests > self.max_queue_len:
            raise QueueFullError(
                f"the server is overloaded: {self.scheduler.num_queued} requests are waiting "
                f"(--max-queue-len {self.max_queue_len}); retry later"
            )

    def add(self, token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None) -> int:
        """Queue a request (raises InvalidRequestError); read its deltas with `stream`."""
        arrival = time.monotonic()
        request_id = self.scheduler.add_request(prompt, params, prompt_token_ids=token_ids)
        self._tracked[request_id] = _Tracked(asyncio.Queue(), arrival)
        return request_id

    async def stream(self, request_id: int) -> AsyncIterator[OutputDelta]:
        """The request's deltas until its last one; leaving early aborts the request."""
        tracked = self._tracked[request_id]
        try:
            while True:
                delta: OutputDelta = await tracked.queue.get()
                yield delta
                if delta.output is not None:  # set on the delta that ends the whole request
                    return
        finally:
            if self._tracked.pop(request_id, None) is not None and not self.scheduler.is_finished(request_id):
                self.scheduler.abort(request_id)

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)

    # -- the engine thread ----------------------------------------------------------------
    def _run(self, factory: Callable[[], InferenceEngine]) -> None:
        try:
            self.engine = factory()
            self.scheduler = OnlineScheduler(self.engine)
        except BaseException as exc:  # reported by __init__ in the caller's thread
            self._load_error = exc
            return
        finally:
            self._ready.set()
        last_log = time.monotonic()
        logged_tokens = (self.engine.stats.num_prompt_tokens, self.engine.stats.num_generation_tokens)
        while not self._stopping:
            if not self.scheduler.wait_for_work(timeout=self.stats_interval):
                last_log, logged_tokens = self._maybe_log(last_log, logged_tokens)
                continue
            try:
                deltas = self.scheduler.step()
            except Exception as exc:  # a bug outside any one request: fail them all, keep serving
                logger.exception("engine step failed")
                deltas = self.scheduler.fail_all(f"engine failure: {type(exc).__name__}: {exc}")
            if deltas:
                self._loop.call_soon_threadsafe(self._deliver, deltas, time.monotonic())
            last_log, logged_tokens = self._maybe_log(last_log, logged_tokens)

    def _maybe_log(self, last_log: float, logged: tuple[int, int]) -> tuple[float, tuple[int, int]]:
        now = time.monotonic()
        if now - last_log < self.stats_interval:
            return last_log, logged
        stats, scheduler = self.engine.stats, self.engine.scheduler
        prompt, generated = stats.num_prompt_tokens, stats.num_generation_tokens
        if (prompt, generated) != logged or scheduler.has_unfinished():
            prefix = self.engine.kv_cache.prefix_stats
            hit_rate = prefix.hits / prefix.queries if prefix.queries else 0.0
            logger.info(
                "throughput: prompt %.1f tok/s, generation %.1f tok/s; running %d, waiting %d; "
                "KV cache usage %.1f%%; prefix cache hit rate %.1f%%",
                (prompt - logged[0]) / (now - last_log), (generated - logged[1]) / (now - last_log),
                scheduler.num_running, self.scheduler.num_queued, 100 * self.engine.kv_cache.usage,
                100 * hit_rate,
            )
        return now, (prompt, generated)

    # -- back on the event loop -----------------------------------------------------------
    def _deliver(self, deltas: list[OutputDelta], produced_at: float) -> None:
        metrics = self.metrics
        for delta in deltas:
            tracked = self._tracked.get(delta.request_id)
            if delta.token_ids:
                metrics.generation_tokens.inc(len(delta.token_ids))
            if tracked is not None and delta.token_ids:
                previous = tracked.last_token.get(delta.index)
                if previous is None:
                    if not tracked.last_token:
                        metrics.time_to_first_token.observe(produced_at - tracked.arrival)
                else:
                    metrics.inter_token_latency.observe(produced_at - previous)
                tracked.last_token[delta.index] = produced_at
            if delta.output is not None:
                self._request_done(delta, tracked, produced_at)
            if tracked is not None:
                tracked.queue.put_nowait(delta)

    def _request_done(self, delta: OutputDelta, tracked: _Tracked | None, now: float) -> None:
        metrics, output = self.metrics, delta.output
        metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            metrics.finished(completion.finish_reason or "abort")
        if tracked is not None:
            metrics.e2e_latency.observe(now - tracked.arrival)
            if output.metrics and output.metrics.first_scheduled_time is not None:
                metrics.queue_time.observe(max(output.metrics.first_scheduled_time - tracked.arrival, 0.0))
