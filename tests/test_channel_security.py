"""The engine's channels to other hosts (ZeroMQ over TCP) admit only peers holding the shared
secret: a subscriber without CURVE, or with keys from another secret, never sees a step, and what
such a peer pushes never reaches the engine; without a secret multi-host ranks refuse to start."""

from __future__ import annotations

import time

import pytest
import zmq
from live_server import free_port

from roseinfer.common.channel import ExecutorChannels, WorkerChannels
from roseinfer.common.channel_security import SECRET_ENV, channel_keys
from roseinfer.errors import InvalidRequestError

SECRET = "the secret of this test's hosts"


@pytest.fixture
def engine_end(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    broadcast, reply = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    channels = ExecutorChannels([broadcast], [reply], channel_keys())
    yield channels, broadcast, reply
    channels.close()


def _no_subscriber_within(channels: ExecutorChannels, seconds: float) -> bool:
    try:
        channels.wait_for_subscribers(1, seconds, lambda: None)
    except TimeoutError:
        return True
    return False


def test_a_peer_without_the_secret_is_never_admitted(engine_end, monkeypatch):
    channels, broadcast, reply = engine_end
    context = zmq.Context()
    try:
        plain = context.socket(zmq.SUB)  # no CURVE at all
        plain.setsockopt(zmq.SUBSCRIBE, b"")
        plain.connect(broadcast)
        pusher = context.socket(zmq.PUSH)
        pusher.connect(reply)
        pusher.send(b"forged tokens", flags=zmq.NOBLOCK) if pusher.poll(500, zmq.POLLOUT) else None
        assert _no_subscriber_within(channels, 3)
        assert not channels.reply.poll(500)

        monkeypatch.setenv(SECRET_ENV, "another secret, of another cluster")
        wrong = WorkerChannels(broadcast, reply, keys=channel_keys())
        try:
            assert _no_subscriber_within(channels, 3)
        finally:
            wrong.close()
    finally:
        context.destroy(linger=0)


def test_a_peer_with_the_secret_gets_every_step(engine_end):
    channels, broadcast, reply = engine_end
    worker = WorkerChannels(broadcast, reply, keys=channel_keys())
    try:
        channels.wait_for_subscribers(1, 30, lambda: None)
        channels.send(("step", {"tokens": [1, 2, 3]}))
        assert worker.recv() == ["step", {"tokens": [1, 2, 3]}]
        worker.send(("output", 7))
        deadline = time.monotonic() + 10
        while not channels.reply.poll(100):
            assert time.monotonic() < deadline
        assert channels.reply.recv()
    finally:
        worker.close()


def test_multi_host_ranks_need_a_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(InvalidRequestError, match=SECRET_ENV):
        channel_keys()
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(InvalidRequestError, match="at least 16 characters"):
        channel_keys()
