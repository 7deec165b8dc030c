"""Tool calls in gpt-oss's harmony format (roseinfer/reasoning/harmony.py, through openai-harmony):
a message addressed to `functions.NAME` on the commentary channel, its content the JSON arguments.

The text is the completion with its special tokens kept, whole (no reasoning parser) or as the
harmony reasoning parser hands on its answer: the final channel's text followed by each finished
call's message as harmony renders it (`<|start|>assistant to=functions.NAME...<|call|>`). Either
way openai-harmony's parser reads the messages; the calls come out, the final text is the content.
"""

from __future__ import annotations

from roseinfer.reasoning.harmony import HarmonyParse, parse_messages_text, parse_text
from roseinfer.tool_parsers.base import (
    ContentDelta,
    Delta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
)


def _parse(text: str) -> HarmonyParse:
    """A whole completion (it starts on a channel) or an answer followed by rendered call messages."""
    if text.startswith("<|channel|>"):
        return parse_text(text)
    return parse_messages_text(text)


class HarmonyToolParser(ToolParser):
    name = "harmony"
    keeps_special_tokens = True  # the channels and <|call|> are special tokens
    # A chat template that writes harmony tool calls (tool_parsers/detect.py).
    template_markers = (("<|channel|>", "<|call|>"), ("<|channel|>", "to=functions"))

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        parsed = _parse(text)
        calls = [ToolCall(call.name, call.arguments) for call in parsed.calls]
        return ExtractedToolCalls(parsed.content or None, calls)

    def stream(self) -> ToolCallStream:
        return HarmonyToolCallStream()


class HarmonyToolCallStream(ToolCallStream):
    """Re-reads the text so far at each piece; sends the content's growth and each call once whole."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._content = 0

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        return self._deltas(_parse(self._text))

    def finish(self) -> list[Delta]:
        return self._deltas(_parse(self._text))

    def _deltas(self, parsed: HarmonyParse) -> list[Delta]:
        deltas: list[Delta] = []
        if len(parsed.content) > self._content:
            deltas.append(ContentDelta(parsed.content[self._content:]))
            self._content = len(parsed.content)
        for call in parsed.calls[self._calls_sent:]:
            deltas += self._call_deltas(ToolCall(call.name, call.arguments))
        return deltas
