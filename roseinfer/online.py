"""The seed's `OnlineScheduler`: the engine fed by other threads while one thread steps it.

`add_request` and `abort` may be called from any thread (a web server's event loop) and return at
once: a request is validated and tokenized in the caller's thread, then waits in an inbox that the
engine thread drains before its next step. Nothing a caller does waits for a model step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from roseinfer.engine import InferenceEngine
from roseinfer.outputs import CompletionOutput, OutputDelta, RequestOutput
from roseinfer.sampling_params import SamplingParams


@dataclass
class _Pending:
    request_id: int
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float


class OnlineScheduler:
    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified when there is something to step
        self._inbox: deque[_Pending] = deque()
        self._aborts: set[int] = set()
        self._live: set[int] = set()  # accepted and not finished

    # -- any thread -----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        add_special_tokens: bool = True,
    ) -> int:
        """Validate and queue a request; returns its id (raises InvalidRequestError on bad input)."""
        if prompt_token_ids is None and prompt is not None and not isinstance(prompt, str):
            prompt, prompt_token_ids = None, prompt
        token_ids = self.engine.prompt_token_ids(prompt, prompt_token_ids, add_special_tokens)
        pending = _Pending(
            self.engine.reserve_request_id(), token_ids, sampling_params or SamplingParams(),
            prompt if isinstance(prompt, str) else None, time.monotonic(),
        )
        with self._work:
            self._inbox.append(pending)
            self._live.add(pending.request_id)
            self._work.notify()
        return pending.request_id

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

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def num_queued(self) -> int:
        """Requests not started yet: in the inbox or waiting in the engine."""
        with self._lock:
            return len(self._inbox) + self.engine.scheduler.num_waiting

    def wake(self) -> None:
        """Wake a thread blocked in `wait_for_work` (e.g. to let it stop)."""
        with self._work:
            self._work.notify_all()

    # -- the engine thread ----------------------------------------------------------------
    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request is queued or running (or `timeout`); True if there is work."""
        with self._work:
            return self._work.wait_for(lambda: self._live, timeout)

    def step(self) -> list[OutputDelta]:
        """Admit queued requests, apply aborts, run one engine step. Engine thread only."""
        with self._lock:
            inbox, self._inbox = self._inbox, deque()
            aborts, self._aborts = self._aborts, set()
        deltas: list[OutputDelta] = []
        for pending in inbox:
            if pending.request_id in aborts:
                continue
            try:
                self.engine.add_request(
                    pending.prompt, pending.params, prompt_token_ids=pending.token_ids,
                    request_id=pending.request_id, arrival_time=pending.arrival_time,
                )
            except Exception as exc:  # validated already; anything left ends only this request
                deltas.append(_error_delta(pending.request_id, f"{type(exc).__name__}: {exc}"))
        for request_id in aborts:
            self.engine.abort_request(request_id)
        if self.engine.has_unfinished_requests():
            deltas.extend(self.engine.step())
        finished = {d.request_id for d in deltas if d.output is not None}
        finished |= aborts
        if finished:
            with self._lock:
                self._live -= finished
        return deltas

    def fail_all(self, message: str) -> list[OutputDelta]:
        """End every request with an error (the engine thread hit something it cannot go on from)."""
        with self._lock:
            ids, self._live, self._inbox = set(self._live), set(), deque()
        for request_id in ids:
            self.engine.abort_request(request_id)
        return [_error_delta(request_id, message) for request_id in sorted(ids)]


def _error_delta(request_id: int, message: str) -> OutputDelta:
    """The last delta of a request that ended before it could run."""
    completion = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")
    return OutputDelta(request_id=request_id, index=0, token_ids=[], text="", finished=True,
                       finish_reason="error", error=message,
                       output=RequestOutput(request_id, None, [], [completion]))
