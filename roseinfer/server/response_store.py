"""The Responses API's in-memory store: what `store: true` keeps so that `GET /v1/responses/{id}`
can return a response and `previous_response_id` can continue its conversation.

Bounded three ways, each a `roseinfer serve` flag: at most `max_entries` responses, at most
`max_bytes` of them (their JSON size), each for `ttl` seconds from when it was stored. The oldest
go first when a bound is reached; an expired one is gone as if never stored. Nothing is written to
disk: a restart forgets every response.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_TTL_SECONDS = 3600.0


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as POST returned it
    # The conversation up to and including this response's output, as chat messages (without the
    # request's `instructions`, which OpenAI does not carry over to a continuation).
    messages: list[dict[str, Any]]
    stored_at: float
    size: int


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl: float = DEFAULT_TTL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or max_bytes < 0 or ttl <= 0:
            raise ValueError("the response store needs max_entries >= 0, max_bytes >= 0 and ttl > 0")
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep a response (False: the store is off, or this one alone is over max_bytes)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        if not self.enabled or size > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(response, messages, self.clock(), size)
        self._bytes += size
        self._expire()
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop_oldest()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.size

    def _expire(self) -> None:
        # Entries are in the order they were stored, so the expired ones are at the front.
        deadline = self.clock() - self.ttl
        while self._entries and next(iter(self._entries.values())).stored_at <= deadline:
            self._drop_oldest()
