"""Fields that clients send and this server accepts without acting on them: client bookkeeping
(`client_metadata`), hints an API lets a server ignore (`context_management`, `include` entries it
cannot fill, `reasoning.summary`), and thinking settings for a model that does not think.

Agents send these on every request, so each is logged once per client (its User-Agent) and field,
not per request: the operator learns what is ignored without a log line per turn. What would
change the answer and cannot be honoured is still a 400, named by the request models.
"""

from __future__ import annotations

import logging
import threading

from fastapi import Request

logger = logging.getLogger("roseinfer.server")

# Distinct (client, field) pairs remembered; past this the memory starts over (a log line may repeat).
MAX_REMEMBERED = 4096
_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def client_of(request: Request | None) -> str:
    """The client's name as the logs give it: its User-Agent, bounded."""
    agent = request.headers.get("user-agent") if request is not None else None
    return (agent or "unknown client")[:120]


def log_ignored(request: Request | None, ignored: dict[str, str]) -> None:
    """Log each ignored field (field -> why it changes nothing here) the first time this client
    sends it."""
    if not ignored:
        return
    client = client_of(request)
    with _lock:
        new = {field: why for field, why in ignored.items() if (client, field) not in _seen}
        if len(_seen) + len(new) > MAX_REMEMBERED:
            _seen.clear()
        _seen.update((client, field) for field in new)
    for field, why in new.items():
        logger.info("%s: %s sends %s, which this server accepts and ignores: %s (logged once per client)",
                    request.url.path if request is not None else "-", client, field, why)
