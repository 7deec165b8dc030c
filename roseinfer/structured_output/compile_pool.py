"""The threads grammars compile on: at most `max_workers` compiles at once, each with a time limit,
and a compile nobody waits for any more (its requests were aborted) gives its seat back at once.

llguidance builds a grammar in one native call that drops the GIL and offers no way to stop it,
so a compile that is given up on (timed out, or its last waiter gone) cannot be interrupted: its
thread runs on to the end and its result is dropped, but it no longer counts against
`max_workers`, so the next grammar starts at once. Threads stay bounded all the same: at most
`max_workers + max_orphans` run, orphans included (beyond that new compiles wait), and llguidance's own fuel limits bound how long one
can run (a grammar past them fails with llguidance's error instead of running on).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class CompileTimeout(Exception):
    """The compile ran past its time limit."""


class CompileAbandoned(Exception):
    """Every waiter of the compile released it before it ended."""


@dataclass(eq=False)
class _Job(Generic[T]):
    work: Callable[[], T]
    future: Future[T] = field(default_factory=Future)
    waiters: int = 1
    started: bool = False
    ended: bool = False  # its thread returned and its future is (being) set
    given_up: bool = False  # its last waiter left: cancelled (queued) or orphaned (running)
    orphaned: bool = False  # given up on while running: its result will be dropped
    timer: threading.Timer | None = None


class CompilePool(Generic[T]):
    """Runs `work` callables on threads of its own; see the module docstring.

    `timeout` (seconds, None or 0: none) counts from the moment a compile starts running, not
    while it waits for a seat; past it the future fails with CompileTimeout."""

    def __init__(self, max_workers: int = 2, *, timeout: float | None = None, max_orphans: int | None = None,
                 name: str = "grammar-compile") -> None:
        self.max_workers = max_workers
        self.max_orphans = max_workers if max_orphans is None else max_orphans
        self.timeout = timeout or None
        self._name = name
        self._lock = threading.Lock()
        self._queue: deque[_Job[T]] = deque()
        self._jobs: dict[Future[T], _Job[T]] = {}  # jobs not yet ended, by their futures
        self._running = 0  # running jobs that hold a seat
        self._orphans = 0  # running jobs given up on
        self._closed = False

    def submit(self, work: Callable[[], T]) -> Future[T]:
        """Queue `work` with one waiter (the caller); `join` adds waiters, `release` removes one."""
        job: _Job[T] = _Job(work)
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile pool is shut down")
            self._jobs[job.future] = job
            self._queue.append(job)
            self._dispatch()
        return job.future

    def join(self, future: Future[T]) -> bool:
        """One more waiter of a submitted compile (a second request asking for the same grammar);
        False when it was given up on (submit it again). A compile that ended needs no waiters."""
        with self._lock:
            job = self._jobs.get(future)
            if job is None:
                return not future.cancelled()
            if job.given_up:
                return False
            if not job.ended:
                job.waiters += 1
            return True

    def release(self, future: Future[T]) -> None:
        """A waiter no longer wants the result. When none is left, a queued compile is cancelled
        and a running one is orphaned (its seat goes to the next compile; its result is dropped)."""
        with self._lock:
            job = self._jobs.get(future)
            if job is None or job.ended or job.given_up:
                return
            job.waiters -= 1
            if job.waiters > 0:
                return
            job.given_up = True
            cancel = not job.started
            if cancel:
                self._queue.remove(job)
            else:
                self._orphan(job)
        if cancel:
            future.cancel()  # runs the future's callbacks: outside the lock
            with self._lock:
                del self._jobs[future]
        else:
            _fail(future, CompileAbandoned("every request waiting for this grammar was aborted"))

    @property
    def num_running(self) -> int:
        """Compiles running that hold a seat (at most max_workers)."""
        with self._lock:
            return self._running

    @property
    def num_orphans(self) -> int:
        """Compiles given up on whose threads still run (at most max_orphans)."""
        with self._lock:
            return self._orphans

    def shutdown(self) -> None:
        """Cancel what waits; running compiles are orphaned (their threads end alone)."""
        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            for job in queued:
                del self._jobs[job.future]
            running = [job for job in self._jobs.values() if not job.ended and not job.given_up]
            for job in running:
                self._orphan(job)
        for job in queued:
            job.future.cancel()
        for job in running:  # a caller still waiting is told, not left hanging
            _fail(job.future, CompileAbandoned("the grammar compiler was shut down"))

    # -- inside ------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start queued jobs while seats (and the orphan bound) allow. Holds the lock."""
        # Orphans do not hold seats, but all threads together stay within both bounds.
        while (self._queue and self._running < self.max_workers
               and self._running + self._orphans < self.max_workers + self.max_orphans):
            job = self._queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                del self._jobs[job.future]
                continue
            job.started = True
            self._running += 1
            if self.timeout is not None:
                job.timer = threading.Timer(self.timeout, self._time_out, (job,))
                job.timer.daemon = True
                job.timer.start()
            # Not a daemon (said outright: a thread inherits it from the daemon threads that start
            # compiles): the interpreter waits for a compile at exit (llguidance's native code
            # must not run on while Python finalizes; its fuel limits bound the wait).
            threading.Thread(target=self._run, args=(job,), name=self._name, daemon=False).start()

    def _orphan(self, job: _Job[T]) -> None:
        """Holds the lock."""
        job.given_up = job.orphaned = True
        self._running -= 1
        self._orphans += 1
        if job.timer is not None:
            job.timer.cancel()
        self._dispatch()

    def _time_out(self, job: _Job[T]) -> None:
        with self._lock:
            if job.ended or job.orphaned:
                return
            self._orphan(job)
        _fail(job.future, CompileTimeout(f"did not compile within {self.timeout:g} s"))

    def _run(self, job: _Job[T]) -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = job.work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            error = exc
        with self._lock:
            self._jobs.pop(job.future, None)
            if job.orphaned:
                self._orphans -= 1
            else:
                job.ended = True
                self._running -= 1
                if job.timer is not None:
                    job.timer.cancel()
            self._dispatch()
        if job.orphaned:
            return  # nobody waits for it: the result is dropped
        if error is not None:
            _fail(job.future, error)
        else:
            job.future.set_result(result)


def _fail(future: Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except Exception:  # noqa: BLE001 - already set (a race with shutdown): nothing to tell
        pass
