"""Tool calls in Qwen3-Coder's XML format (Qwen3-Coder, Qwen3.5, Nemotron 3 Nano):

    <tool_call>
    <function=name>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes the JSON type its tool's schema gives it (a number, a
boolean, an object or array written as JSON), else a string. The text before the first
<tool_call> is content; a response whose calls do not parse is content as written.
"""

from __future__ import annotations

import json
import re
from typing import Any

from roseinfer.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolCallStream, ToolParser
from roseinfer.tool_parsers.held import HeldAfterMarkerStream

START = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    template_markers = ((START, "<function=", "<parameter="),)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls, position = [], start
        for match in _CALL.finditer(text, start):
            if text[position:match.start()].strip():
                return ExtractedToolCalls(text, [])  # text between calls: not a calls block
            name, body = match.group(1), match.group(2)
            arguments = {key: self._typed(name, key, value) for key, value in _PARAMETER.findall(body)}
            calls.append(ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
            position = match.end()
        if not calls or text[position:].strip():
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(text[:start].rstrip() or None, calls)

    def stream(self) -> ToolCallStream:
        return HeldAfterMarkerStream(self, START)

    def _typed(self, function: str, key: str, value: str) -> Any:
        if self.parameter_schema(function, key).get("type") == "string":
            return value
        return _json_or_text(value)


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value
