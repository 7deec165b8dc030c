"""Tool calls in Mistral's formats, after the [TOOL_CALLS] control token (which the response must
keep: `keeps_special_tokens`):

    [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]      (Mistral Nemo, v3 tokenizers)
    [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}              (Small 3.2, Devstral, Ministral 3)

The text before the first [TOOL_CALLS] is content; calls that do not parse leave the whole
response as content, as written.
"""

from __future__ import annotations

import json
import re

from roseinfer.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_from_json,
)
from roseinfer.tool_parsers.held import HeldAfterMarkerStream

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_CALL_ID = re.compile(r"\[CALL_ID\][^\[]*")  # a call id some versions write before [ARGS]
_decoder = json.JSONDecoder()


def _json_calls(body: str) -> list[ToolCall] | None:
    try:
        value, end = _decoder.raw_decode(body.strip())
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_from_json(item, ("arguments", "parameters")) for item in items]
    return calls if calls and None not in calls else None


def _named_call(body: str) -> ToolCall | None:
    name, sep, arguments = _CALL_ID.sub("", body, count=1).partition(ARGS)
    if not sep or not name.strip():
        return None
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return ToolCall(name=name.strip(), arguments=json.dumps(value, ensure_ascii=False))


class MistralToolParser(ToolParser):
    name = "mistral"
    template_markers = ((TOOL_CALLS,),)
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return ExtractedToolCalls(text, [])
        bodies = text[start:].split(TOOL_CALLS)[1:]
        calls: list[ToolCall] = []
        for body in bodies:
            found = _json_calls(body) if body.lstrip().startswith(("[", "{")) else None
            if found is None:
                call = _named_call(body)
                found = [call] if call is not None else None
            if found is None:
                return ExtractedToolCalls(text, [])
            calls += found
        return ExtractedToolCalls(text[:start].rstrip() or None, calls)

    def stream(self) -> ToolCallStream:
        return HeldAfterMarkerStream(self, TOOL_CALLS)
