"""The Responses API's in-memory store: its three bounds (entries, bytes, time to live)."""

from __future__ import annotations

import json

import pytest

from roseinfer.server.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def response(i: int, padding: int = 0) -> dict:
    return {"id": f"resp_{i}", "output": "x" * padding}


def test_entries_bound_drops_the_oldest_first():
    store = ResponseStore(max_entries=3, ttl=60, clock=Clock())
    for i in range(5):
        assert store.put(f"resp_{i}", response(i), [{"role": "user", "content": str(i)}])
    assert len(store) == 3
    assert [store.get(f"resp_{i}") is None for i in range(5)] == [True, True, False, False, False]
    assert store.get("resp_4").messages == [{"role": "user", "content": "4"}]


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl=60, clock=clock)
    store.put("resp_a", response(0), [])
    clock.now += 30
    store.put("resp_b", response(1), [])
    clock.now += 29.5
    assert store.get("resp_a") is not None and store.get("resp_b") is not None
    clock.now += 1  # resp_a is 60.5 s old, resp_b 30.5 s
    assert store.get("resp_a") is None and store.get("resp_b") is not None
    clock.now += 30
    assert store.get("resp_b") is None and len(store) == 0


def test_bytes_bound_counts_the_json_of_response_and_messages():
    one = len(json.dumps(response(0, 100))) + len(json.dumps([]))
    store = ResponseStore(max_entries=100, max_bytes=2 * one + 10, ttl=60, clock=Clock())
    for i in range(3):
        assert store.put(f"resp_{i}", response(i, 100), [])
    assert store.get("resp_0") is None and store.get("resp_1") is not None and store.get("resp_2") is not None
    # One response larger than the whole budget is not kept, and evicts nothing.
    assert not store.put("resp_big", response(9, 10 * one), [])
    assert store.get("resp_big") is None and len(store) == 2


def test_delete_and_a_disabled_store():
    store = ResponseStore(max_entries=2, ttl=60, clock=Clock())
    store.put("resp_a", response(0), [])
    assert store.delete("resp_a") and not store.delete("resp_a") and store.get("resp_a") is None
    off = ResponseStore(max_entries=0)
    assert not off.enabled and not off.put("resp_a", response(0), []) and off.get("resp_a") is None
    with pytest.raises(ValueError, match="ttl"):
        ResponseStore(ttl=0)
