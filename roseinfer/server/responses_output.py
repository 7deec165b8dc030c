"""A Responses API response's output items, built from what the engine generated, and the typed
stream events that announce them, in the API's order.

What comes in is a sequence of pieces: answer text, tool-call pieces (from the tool-call parser
or the constrained tool choice), and reasoning text. A piece of another kind than the open item
closes that item and opens the next, so items come out in the order the model wrote them:

    reasoning  -> {"type": "reasoning", "content": [{"type": "reasoning_text", ...}]}
    text       -> {"type": "message", "content": [{"type": "output_text", ...}]}
    tool call  -> {"type": "function_call", "call_id", "name", "arguments"}

Reasoning: with --reasoning-parser the route feeds the parser's thinking here before the answer
text (see responses_api._feed).

A whole response is built by the same pieces as a stream, so the two cannot disagree.
"""

from __future__ import annotations

from typing import Any

from roseinfer.server.protocol import new_id
from roseinfer.tool_parsers import ContentDelta, Delta, ToolCallDelta

Event = dict[str, Any]


def _item_id(prefix: str) -> str:
    return new_id(prefix).replace("-", "_")


class OutputBuilder:
    def __init__(self, namespaces: dict[str, str] | None = None) -> None:
        self.items: list[dict[str, Any]] = []  # the output so far; the open item, if any, is last
        self._open: dict[str, Any] | None = None
        self._namespaces = namespaces or {}  # function name -> its namespace tool's name

    # -- pieces -------------------------------------------------------------------------------
    def text(self, delta: str) -> list[Event]:
        """Answer text (an empty delta opens the message item without writing to it)."""
        events = self._ensure("message")
        if delta:
            part = self._open["content"][0]
            part["text"] += delta
            events.append(self._content_event("response.output_text.delta", delta=delta, logprobs=[]))
        return events

    def reasoning(self, delta: str) -> list[Event]:
        """The model's thinking (a reasoning parser's `reasoning_content`)."""
        events = self._ensure("reasoning")
        if delta:
            self._open["content"][0]["text"] += delta
            events.append(self._content_event("response.reasoning_text.delta", delta=delta))
        return events

    def tool_call(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.id is not None:  # a call's first piece: a new item
            events += self.close("completed")
            self._open = {"id": _item_id("fc"), "type": "function_call", "call_id": piece.id,
                          "name": piece.name or "", "arguments": "", "status": "in_progress"}
            if piece.name in self._namespaces:
                self._open["namespace"] = self._namespaces[piece.name]
            events.append(self._added())
        elif self._open is None or self._open["type"] != "function_call":
            raise ValueError("a tool call's arguments came before its name")
        if piece.arguments:
            self._open["arguments"] += piece.arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": self._open["id"],
                           "output_index": self._index, "delta": piece.arguments})
        return events

    def delta(self, piece: Delta) -> list[Event]:
        """A tool-call stream's piece (content or call)."""
        return self.text(piece.text) if isinstance(piece, ContentDelta) else self.tool_call(piece)

    def close(self, status: str) -> list[Event]:
        """Finish the open item (with `status`: "completed", or "incomplete" where the response
        was cut short)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        events: list[Event] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": self._index_of(item), "name": item["name"],
                           "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {"text": part["text"]} | ({"logprobs": []} if kind == "output_text" else {})
            events.append(self._content_event(f"response.{kind}.done", item, **done))
            events.append(self._content_event("response.content_part.done", item, part=dict(part)))
        events.append({"type": "response.output_item.done", "output_index": self._index_of(item),
                       "item": _copy(item)})
        return events

    # -- helpers ------------------------------------------------------------------------------
    def _ensure(self, kind: str) -> list[Event]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self.close("completed")
        if kind == "message":
            self._open = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                          "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            self._open = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                          "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        events.append(self._added())
        self._open["content"].append(part)
        events.append(self._content_event("response.content_part.added", part=dict(part)))
        return events

    def _added(self) -> Event:
        self.items.append(self._open)
        return {"type": "response.output_item.added", "output_index": self._index, "item": _copy(self._open)}

    @property
    def _index(self) -> int:
        return self._index_of(self._open)

    def _index_of(self, item: dict[str, Any]) -> int:
        return next(i for i, candidate in enumerate(self.items) if candidate is item)

    def _content_event(self, kind: str, item: dict[str, Any] | None = None, **fields: Any) -> Event:
        item = item if item is not None else self._open
        return {"type": kind, "item_id": item["id"], "output_index": self._index_of(item), "content_index": 0,
                **fields}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(part) for part in item["content"]]} if "content" in item else dict(item)
