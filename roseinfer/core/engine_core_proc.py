"""The engine core's busy loop, and the engine core as a process of its own.

`EngineCoreLoop` takes requests and aborts from a queue, steps the core while it has work and
hands every batch of outputs to `emit`; it sleeps on the queue when there is nothing to do. In a
background thread (`core_client.ThreadedEngineCoreClient`) `emit` wakes the event loop; in a
process of its own (`run_engine_core_process`, like vLLM's EngineCoreProc) two I/O threads move
msgpack messages between ZeroMQ sockets and the queues, so encoding never holds up a step.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

from roseinfer.common.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.core.engine_core import EngineCore
from roseinfer.core.request import RequestStatus

logger = logging.getLogger("roseinfer")

# Messages into the loop: (kind, payload).
ADD = "add"  # payload: list[EngineCoreRequest]
ABORT = "abort"  # payload: list[str]
RESET_PREFIX_CACHE = "reset_prefix_cache"
SHUTDOWN = "shutdown"
EXECUTOR_FAILED = "executor_failed"  # payload: the reason (from the executor's watcher thread)
# The first message out of an engine-core process: ("ready", None) or ("failed", message).
READY, FAILED = "ready", "failed"


class EngineCoreLoop:
    def __init__(self, core: EngineCore, inputs: queue.Queue, emit: Callable[[EngineCoreOutputs], None]) -> None:
        self.core = core
        self.inputs = inputs
        self.emit = emit
        self.running = True
        core.executor.register_failure_callback(lambda reason: inputs.put((EXECUTOR_FAILED, reason)))

    def run(self) -> None:
        core = self.core
        while self.running:
            changed = self._handle(self.inputs.get()) if not core.has_unfinished_requests() else False
            while self.running:
                try:
                    changed = self._handle(self.inputs.get_nowait()) or changed
                except queue.Empty:
                    break
            if not self.running:
                break
            if core.has_unfinished_requests():
                self.emit(self._step())
                if core.dead_reason is not None:  # the executor failed: its requests have ended
                    self.running = False
            elif changed:  # aborts freed blocks: the stats snapshot must say so
                self.emit(EngineCoreOutputs([], core.scheduler.make_stats()))

    def _handle(self, message: tuple[str, Any]) -> bool:
        kind, payload = message
        if kind == ADD:
            for request in payload:
                self._add(request)
        elif kind == ABORT:
            self.core.abort_requests(payload)
        elif kind == RESET_PREFIX_CACHE:
            self.core.reset_prefix_cache()
        elif kind == SHUTDOWN:
            self.running = False
        elif kind == EXECUTOR_FAILED:
            self.emit(self.core.fail_all(payload))
            self.running = False
        else:
            logger.error("engine core: unknown message %r", kind)
            return False
        return True

    def _add(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except Exception as exc:  # the front end checked it; if the core still refuses, end only it
            logger.exception("engine core: could not add request %s", request.request_id)
            error = EngineCoreOutput(request.request_id, [], finish_reason="error",
                                     error=f"{type(exc).__name__}: {exc}")
            self.emit(EngineCoreOutputs([error], self.core.scheduler.make_stats()))

    def _step(self) -> EngineCoreOutputs:
        try:
            return self.core.step()
        except Exception as exc:  # a bug outside any one request: end them all, keep serving
            logger.exception("engine step failed")
            message = f"engine failure: {type(exc).__name__}: {exc}"
            scheduler = self.core.scheduler
            ids = list(scheduler.requests)
            try:
                scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            except Exception:  # the scheduler itself is broken: nothing sensible is left to do
                logger.exception("could not end the requests of the failed step")
                self.running = False
            outputs = [EngineCoreOutput(i, [], finish_reason="error", error=message) for i in ids]
            return EngineCoreOutputs(outputs, scheduler.make_stats())


def run_engine_core_process(
    config: EngineConfig, model_config: ModelConfig, input_address: str, output_address: str, log_level: int
) -> None:
    """The engine-core process: build the core, say ready, serve the sockets until told to stop
    (or until the parent process dies)."""
    import zmq

    from roseinfer.common import serial

    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s[core]: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    _exit_with_parent()
    context = zmq.Context()
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    try:
        core = EngineCore(config, model_config)
    except BaseException as exc:
        output_socket.send(serial.encode((FAILED, f"{type(exc).__name__}: {exc}")))
        raise
    inputs: queue.Queue = queue.Queue()
    outputs: queue.Queue = queue.Queue()
    loop = EngineCoreLoop(core, inputs, outputs.put)
    signal.signal(signal.SIGTERM, lambda *_: inputs.put((SHUTDOWN, None)))

    def read_inputs() -> None:
        socket = context.socket(zmq.PULL)
        socket.connect(input_address)
        while True:
            message = serial.decode(socket.recv())
            inputs.put((message[0], message[1]))
            if message[0] == SHUTDOWN:
                return

    def write_outputs() -> None:
        while True:
            batch = outputs.get()
            if batch is None:
                return
            output_socket.send(serial.encode(batch))

    threading.Thread(target=read_inputs, name="core-input", daemon=True).start()
    writer = threading.Thread(target=write_outputs, name="core-output", daemon=True)
    writer.start()
    output_socket.send(serial.encode((READY, None)))
    try:
        loop.run()
    finally:
        outputs.put(None)
        writer.join(timeout=5)
        core.shutdown()


def _exit_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so no engine core is left behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:  # not Linux: the front end's shutdown still stops the process
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
