"""How the front end reaches an engine core that runs beside it: in a background thread of this
process, or in a process of its own over ZeroMQ.

Both clients take requests and aborts from the caller's thread without waiting for a step, and
hand each batch of `EngineCoreOutputs` to `deliver` from a thread of their own; `on_dead` is
called once if the engine core stops without being asked to.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from roseinfer.common import serial
from roseinfer.common.messages import EngineCoreOutputs, EngineCoreRequest
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.core.engine_core import EngineCore
from roseinfer.core.engine_core_proc import (
    ABORT,
    ADD,
    FAILED,
    READY,
    RESET_PREFIX_CACHE,
    SHUTDOWN,
    EngineCoreLoop,
    run_engine_core_process,
)
from roseinfer.errors import EngineDeadError

logger = logging.getLogger("roseinfer")

Deliver = Callable[[EngineCoreOutputs], None]
OnDead = Callable[[str], None]


class EngineCoreClient:
    """The interface AsyncLLM uses."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(ADD, requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(ABORT, request_ids)

    def reset_prefix_cache(self) -> None:
        self._send(RESET_PREFIX_CACHE, None)

    def _send(self, kind: str, payload: object) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError


class ThreadedEngineCoreClient(EngineCoreClient):
    """The engine core in a background thread. `make_core` runs in that thread: PyTorch's OpenMP
    pools are per calling thread, and a model loaded in one thread and run in another made every
    step ~30% slower on a 2-core machine (the idle pool's threads sleep instead of spinning)."""

    def __init__(self, make_core: Callable[[], EngineCore], deliver: Deliver, on_dead: OnDead) -> None:
        self._inputs: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._stopping = False
        self.engine_core: EngineCore | None = None
        self._thread = threading.Thread(
            target=self._run, args=(make_core, deliver, on_dead), name="roseinfer-engine", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    def _run(self, make_core: Callable[[], EngineCore], deliver: Deliver, on_dead: OnDead) -> None:
        try:
            self.engine_core = make_core()
        except BaseException as exc:  # reported by __init__ in the caller's thread
            self._load_error = exc
            return
        finally:
            self._ready.set()
        try:
            EngineCoreLoop(self.engine_core, self._inputs, deliver).run()
        except BaseException as exc:
            logger.exception("the engine loop stopped")
            on_dead(f"the engine loop stopped: {type(exc).__name__}: {exc}")
            return
        if not self._stopping:
            on_dead(self.engine_core.dead_reason or "the engine loop stopped")

    def _send(self, kind: str, payload: object) -> None:
        self._inputs.put((kind, payload))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inputs.put((SHUTDOWN, None))
        self._thread.join(timeout)


class ProcessEngineCoreClient(EngineCoreClient):
    """The engine core in a process of its own (multiprocessing spawn), reached over ZeroMQ IPC
    sockets with msgpack messages. A reader thread decodes outputs; a watcher notices the process
    dying."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, deliver: Deliver, on_dead: OnDead,
        start_timeout: float = 600.0,
    ) -> None:
        import zmq

        self._stopping = False
        self._reader_owns_output = False
        self._lock = threading.Lock()  # zmq sockets are not thread-safe
        self._directory = tempfile.TemporaryDirectory(prefix="roseinfer-core-")
        input_address = f"ipc://{Path(self._directory.name) / 'input'}"
        output_address = f"ipc://{Path(self._directory.name) / 'output'}"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core_process,
            args=(config, model_config, input_address, output_address, logging.getLogger().getEffectiveLevel()),
            name="roseinfer-engine-core", daemon=True,
        )
        self._process.start()
        self._wait_until_ready(start_timeout)
        self._reader_owns_output = True  # from here on only the reader thread touches that socket
        threading.Thread(target=self._read_outputs, args=(deliver,), name="core-output-reader", daemon=True).start()
        threading.Thread(target=self._watch, args=(on_dead,), name="core-watcher", daemon=True).start()

    def _wait_until_ready(self, timeout: float) -> None:
        import zmq

        waited = 0.0
        while not self._output.poll(500, zmq.POLLIN):
            waited += 0.5
            if not self._process.is_alive() or waited > timeout:
                self._close()
                raise EngineDeadError(
                    f"the engine-core process did not start (exit code {self._process.exitcode})"
                )
        kind, detail = serial.decode(self._output.recv())
        if kind == FAILED:
            self._process.join(10)
            self._close()
            raise EngineDeadError(f"the engine-core process failed to start: {detail}")
        assert kind == READY, kind

    def _read_outputs(self, deliver: Deliver) -> None:
        import zmq

        while True:
            try:
                data = self._output.recv()
            except zmq.ZMQError:  # the context is being terminated (shutdown): close and leave
                self._output.close(linger=0)
                return
            deliver(serial.decode(data))

    def _watch(self, on_dead: OnDead) -> None:
        self._process.join()
        if not self._stopping:
            on_dead(f"the engine-core process exited (exit code {self._process.exitcode})")

    def _send(self, kind: str, payload: object) -> None:
        with self._lock:
            if self._input.closed:
                raise EngineDeadError("the engine-core process has stopped")
            self._input.send(serial.encode((kind, payload)))

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._process.is_alive():
            self._send(SHUTDOWN, None)
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
        self._close()

    def _close(self) -> None:
        with self._lock:
            self._input.close(linger=0)
        if not self._reader_owns_output:
            self._output.close(linger=0)
        self._context.term()  # wakes the reader thread, which closes its socket
        self._directory.cleanup()
