"""The messages between a multiprocess executor and its workers, over ZeroMQ with msgpack.

    executor --XPUB--> SUB of every worker    the same message to all ranks (SchedulerOutputs)
    executor <--PULL-- PUSH of every worker   replies: rank 0's sampled tokens, readiness, errors

IPC sockets when all ranks are on one host (a 0700 directory), TCP on host 0 when they span hosts:
then bound to the address the other hosts connect to, authenticated and encrypted with CURVE keys
from a shared secret (channel_security.py), and with size caps on what a peer may send. The XPUB socket
sees each worker's subscription, so the executor sends nothing until every rank is listening (a
plain PUB would drop what it sends before a late subscriber connects). A worker leaves when its
broadcast connection drops: the engine is gone (ZeroMQ heartbeats notice a host that vanished).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from roseinfer.common import serial
from roseinfer.common.channel_security import (
    CurveKeys,
    make_client,
    make_server,
    start_authenticator,
)
from roseinfer.config import EngineConfig, ModelConfig, MoeConfig

# The configuration travels to every rank (remote hosts included) in the first broadcast.
serial.register(EngineConfig)
serial.register(ModelConfig)
serial.register(MoeConfig)  # ModelConfig.moe of a mixture-of-experts model

_HEARTBEAT_MS = 2000
_HEARTBEAT_TIMEOUT_MS = 20000
# Steps are sent in lockstep (each waits for rank 0's reply), so a worker never has more than a
# few queued; a queue this long means one stopped reading. Refusing then (XPUB_NODROP) beats both
# dropping a step (ranks out of step) and growing without bound.
_BROADCAST_QUEUE = 1000
# The largest message a peer may send: replies carry sampled tokens (and, for tests, a step's
# logits); broadcasts carry SchedulerOutputs and, once, the configuration.
MAX_REPLY_BYTES = 1 << 30
MAX_BROADCAST_BYTES = 256 << 20


class ExecutorChannels:
    def __init__(self, broadcast_addresses: list[str], reply_addresses: list[str],
                 keys: CurveKeys | None = None) -> None:
        self.context = zmq.Context()
        self.authenticator = start_authenticator(self.context, keys) if keys is not None else None
        self.broadcast = self.context.socket(zmq.XPUB)
        self.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, even repeated ones
        self.broadcast.setsockopt(zmq.SNDHWM, _BROADCAST_QUEUE)
        self.broadcast.setsockopt(zmq.XPUB_NODROP, 1)
        self.broadcast.setsockopt(zmq.LINGER, 0)
        self.broadcast.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.broadcast.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self.reply = self.context.socket(zmq.PULL)
        self.reply.setsockopt(zmq.RCVHWM, 0)
        self.reply.setsockopt(zmq.LINGER, 0)
        self.reply.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        if keys is not None:
            make_server(self.broadcast, keys)
            make_server(self.reply, keys)
        for address in broadcast_addresses:
            self.broadcast.bind(address)
        for address in reply_addresses:
            self.reply.bind(address)

    def wait_for_subscribers(self, count: int, timeout_s: float, check: Callable[[], None]) -> None:
        """Return once `count` workers subscribe; `check()` raises if waiting is pointless (a
        worker died). Raises TimeoutError naming how many came."""
        seen, deadline = 0, time.monotonic() + timeout_s
        while seen < count:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{seen} of {count} workers connected within {timeout_s:.0f} s")
            if self.broadcast.poll(200, zmq.POLLIN):
                if self.broadcast.recv()[:1] == b"\x01":  # a subscription (b"\x00": one went away)
                    seen += 1

    def send(self, message: Any) -> None:
        try:
            self.broadcast.send(serial.encode(message), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise WorkerStalledError(f"a worker has {_BROADCAST_QUEUE} steps it has not read") from exc

    def close(self) -> None:
        self.broadcast.close(linger=0)
        self.reply.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.context.term()


class WorkerStalledError(Exception):
    """A worker stopped reading the broadcast."""


class EngineGoneError(Exception):
    """The executor's end of the broadcast went away."""


class WorkerChannels:
    """A worker's end. `parent_pid`: the process that started the worker; if it dies before the
    broadcast connection is up (so no disconnect can be seen), the worker leaves too."""

    def __init__(self, broadcast_address: str, reply_address: str, parent_pid: int | None = None,
                 keys: CurveKeys | None = None) -> None:
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.broadcast = self.context.socket(zmq.SUB)
        self.broadcast.setsockopt(zmq.RCVHWM, 0)
        self.broadcast.setsockopt(zmq.MAXMSGSIZE, MAX_BROADCAST_BYTES)
        self.broadcast.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.broadcast.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self.monitor = self.broadcast.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.broadcast.setsockopt(zmq.SUBSCRIBE, b"")
        self.reply = self.context.socket(zmq.PUSH)
        self.reply.setsockopt(zmq.LINGER, 5000)  # let a last error report leave before exiting
        self.reply.setsockopt(zmq.SNDTIMEO, 60000)
        if keys is not None:
            make_client(self.broadcast, keys)
            make_client(self.reply, keys)
        self.broadcast.connect(broadcast_address)
        self.reply.connect(reply_address)
        self.poller = zmq.Poller()
        self.poller.register(self.broadcast, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def recv(self) -> Any:
        """The next broadcast message; raises EngineGoneError if the executor disconnected."""
        while True:
            events = dict(self.poller.poll(1000))
            if not events and self.parent_pid is not None and os.getppid() != self.parent_pid:
                raise EngineGoneError("the process that started this worker has exited")
            if self.broadcast in events:
                return serial.decode(self.broadcast.recv())
            if self.monitor in events:
                event = recv_monitor_message(self.monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    raise EngineGoneError("the engine's broadcast connection closed")

    def send(self, message: Any) -> None:
        try:
            self.reply.send(serial.encode(message))
        except zmq.Again as exc:
            raise EngineGoneError("the engine stopped taking replies") from exc

    def close(self) -> None:
        self.broadcast.disable_monitor()
        self.monitor.close(linger=0)
        self.broadcast.close(linger=0)
        self.reply.close()
        self.context.term()
