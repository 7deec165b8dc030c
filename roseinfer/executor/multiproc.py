"""The multiprocess executor: one worker process per tensor-parallel rank, driven over ZeroMQ.

Each step's `SchedulerOutput` is encoded once and broadcast to every rank (common/channel.py);
each rank runs its shard of the model (the ranks meet only in the model's all-reduces and the
logits gather) and rank 0 sends back the sampled tokens. Ranks on other hosts connect to host 0.

Failure: a worker that raises reports it and exits; one that dies closes its process sentinel,
which the executor polls together with the reply socket (and a watcher thread while the engine
is idle). Either way the executor kills the remaining local workers and raises
`ExecutorFailedError`, and the engine core ends every request with an error and stops.
"""

from __future__ import annotations

import atexit
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from roseinfer.common import serial
from roseinfer.common.channel import ExecutorChannels, WorkerStalledError
from roseinfer.common.channel_security import channel_keys
from roseinfer.common.messages import ModelRunnerOutput, SchedulerOutput
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.distributed.layout import distributed_layout
from roseinfer.errors import ExecutorFailedError, InvalidRequestError
from roseinfer.executor.base import Executor
from roseinfer.executor.local_workers import LocalWorkers
from roseinfer.step_timings import PhaseClock, StepTimings

logger = logging.getLogger("roseinfer")

class MultiprocExecutor(Executor):
    START_TIMEOUT_S = 600.0  # every rank connected and loaded (remote hosts may start later)

    def __init__(self, config: EngineConfig, model_config: ModelConfig, timings: StepTimings) -> None:
        layout = distributed_layout(config).with_free_port()
        if not layout.runs_engine:
            raise InvalidRequestError(
                "this host runs workers only (node_rank > 0): start it with `roseinfer serve` or "
                "`roseinfer generate`, which then serve host 0's engine", "node_rank",
            )
        self.world_size = layout.world_size
        self.timings = timings
        self.dead_reason: str | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._directory = tempfile.TemporaryDirectory(prefix="roseinfer-tp-")
        if layout.multi_host:
            # Bound to the address the other hosts reach this one by, not every interface;
            # authenticated and encrypted (channel_security.py).
            broadcast, reply = layout.tcp_message_addresses()
            self.channels = ExecutorChannels([_bindable(broadcast)], [_bindable(reply)], channel_keys())
        else:
            broadcast = f"ipc://{Path(self._directory.name) / 'broadcast'}"
            reply = f"ipc://{Path(self._directory.name) / 'reply'}"
            self.channels = ExecutorChannels([broadcast], [reply])
        self.workers = LocalWorkers(config, layout, broadcast, reply)
        try:
            self._start(config, model_config)
        except BaseException:
            self.workers.kill()
            self._close()
            raise
        threading.Thread(target=self._watch, name="tp-worker-watcher", daemon=True).start()
        atexit.register(self.shutdown)  # an engine nobody shut down still stops its workers in order

    def _start(self, config: EngineConfig, model_config: ModelConfig) -> None:
        started = time.monotonic()
        try:
            self.channels.wait_for_subscribers(self.world_size, self.START_TIMEOUT_S, self._check_workers)
        except TimeoutError as exc:
            raise ExecutorFailedError(f"tensor-parallel workers did not start: {exc}") from exc
        self._send(("init", (config, model_config)))
        self._collect("ready", self.world_size, timeout_s=self.START_TIMEOUT_S)
        logger.info("%d tensor-parallel ranks ready in %.1fs", self.world_size, time.monotonic() - started)

    # -- steps ----------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        clock = PhaseClock(self.timings)
        self._send(("step", scheduler_output))
        output = self._collect("output", 1)[0]
        clock.lap("forward")  # the whole remote step, as seen from here
        return output

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a worker method (worker.RPC_METHODS) on every rank; the results in rank order."""
        self._send(("rpc", (method, list(args))))
        return self._collect("rpc", self.world_size)

    def compute_logits(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """A step's raw logits from rank 0, nothing sampled (tests; the runner's compute_logits)."""
        logits, req_ids = self.collective_rpc("compute_logits", scheduler_output)[0]
        return torch.from_numpy(np.array(logits)), req_ids

    def _send(self, message: tuple[str, Any]) -> None:
        if self.dead_reason is not None:
            raise ExecutorFailedError(self.dead_reason)
        try:
            self.channels.send(message)
        except WorkerStalledError as exc:
            raise ExecutorFailedError(f"tensor-parallel workers stopped: {exc}") from exc

    def _collect(self, kind: str, count: int, timeout_s: float | None = None) -> list[Any]:
        """Wait for `count` replies of `kind` (in rank order); fail on an error reply or a dead
        local worker."""
        poller = zmq.Poller()
        poller.register(self.channels.reply, zmq.POLLIN)
        for sentinel in self.workers.sentinels:
            poller.register(sentinel, zmq.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        replies: dict[int, Any] = {}
        while len(replies) < count:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(wait_ms))
            if self.channels.reply in events:
                reply_kind, rank, payload = serial.decode(self.channels.reply.recv())
                if reply_kind == "error":
                    self._fail(f"tensor-parallel rank {rank} failed: {payload}")
                if reply_kind == kind:
                    replies[rank] = payload
                continue
            self._check_workers()
            if self.dead_reason is not None:
                raise ExecutorFailedError(self.dead_reason)
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(f"{count - len(replies)} tensor-parallel rank(s) did not answer in {timeout_s:.0f} s")
        return [replies[rank] for rank in sorted(replies)]

    # -- failure --------------------------------------------------------------------------
    def _check_workers(self) -> None:
        dead = self.workers.first_dead()
        if dead is not None:
            self._fail(f"tensor-parallel rank {dead[0]} exited (exit code {dead[1]})")

    def _fail(self, reason: str, raise_error: bool = True) -> None:
        with self._lock:
            first = self.dead_reason is None and not self._stopping
            if first:
                self.dead_reason = reason
        if first:
            logger.error("executor failed: %s; stopping every worker", reason)
            self.workers.kill()
            for callback in self._failure_callbacks:
                callback(reason)
        if raise_error:
            raise ExecutorFailedError(self.dead_reason or reason)

    def _watch(self) -> None:
        """Notice a worker dying while no step is running (a step notices it itself)."""
        rank, code = self.workers.wait_any()
        if not self._stopping:
            self._fail(f"tensor-parallel rank {rank} exited (exit code {code})", raise_error=False)

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:
        self._failure_callbacks.append(callback)

    # -- life cycle -----------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self.dead_reason is None:
            try:
                self.channels.send(("shutdown", None))
            except (zmq.ZMQError, WorkerStalledError):
                pass
            self.workers.stop()
        else:
            self.workers.kill()
        self._close()

    def _close(self) -> None:
        self.channels.close()
        self._directory.cleanup()


def _bindable(address: str) -> str:
    """tcp://name:port with the name resolved to its address (ZeroMQ binds interfaces, not names)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if host.startswith("["):
        return address
    return f"tcp://{socket.gethostbyname(host)}:{port}"
