"""Tool calls in Llama 3's JSON format: the whole response is {"name": ..., "parameters": {...}},
or several such objects separated by ";", optionally after <|python_tag|>.

A response that starts that way but is not entirely such calls is content as written.
"""

from __future__ import annotations

import json

from roseinfer.tool_parsers.base import (
    ContentDelta,
    Delta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_json,
)

PYTHON_TAG = "<|python_tag|>"  # a special token: often already dropped by the detokenizer
_decoder = json.JSONDecoder()


def _parse_calls(text: str) -> list[ToolCall] | None:
    """The calls when `text` is nothing but calls separated by ";", else None."""
    body = text.strip().removeprefix(PYTHON_TAG)
    calls, position = [], 0
    while True:
        while position < len(body) and body[position].isspace():
            position += 1
        try:
            value, position = _decoder.raw_decode(body, position)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            return None
        call = call_from_json(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = body[position:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        position = len(body) - len(rest) + 1


def _looks_like_calls(stripped: str) -> bool:
    return stripped.startswith(("{", PYTHON_TAG))


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    # Llama 3.1/3.3 name the tag; 3.2 only asks for the JSON ("a dictionary of argument name and its value").
    template_markers = ((PYTHON_TAG,), ("dictionary of argument name",))

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if _looks_like_calls(text.lstrip()):
            calls = _parse_calls(text)
            if calls is not None:
                return ExtractedToolCalls(None, calls)
        return ExtractedToolCalls(text, [])

    def stream(self) -> ToolCallStream:
        return Llama3JsonToolCallStream()


class Llama3JsonToolCallStream(ToolCallStream):
    """Waits for the first characters to tell: a response that does not start like a call
    streams as content; one that does is held and parsed once it ends."""

    def __init__(self) -> None:
        super().__init__()
        self._pieces: list[str] = []  # the text held so far
        self._mode: str | None = None  # None (undecided), "content" or "calls"

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "content":
            return [ContentDelta(text)] if text else []
        self._pieces.append(text)
        if self._mode is None:
            held = "".join(self._pieces)
            self._pieces = [held]
            stripped = held.lstrip()
            if not stripped or (PYTHON_TAG.startswith(stripped) and stripped != PYTHON_TAG):
                return []  # only whitespace, or part of the tag, so far
            if _looks_like_calls(stripped):
                self._mode = "calls"
            else:
                self._mode, self._pieces = "content", []
                return [ContentDelta(held)]
        return []

    def finish(self) -> list[Delta]:
        text, self._pieces = "".join(self._pieces), []
        calls = _parse_calls(text) if self._mode == "calls" else None
        if calls is None:
            return [ContentDelta(text)] if text else []
        return [delta for call in calls for delta in self._call_deltas(call)]
