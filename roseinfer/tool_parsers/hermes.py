"""Tool calls in the Hermes format (Qwen2.5, Qwen3, Hermes models): one
<tool_call>{"name": ..., "arguments": {...}}</tool_call> block per call, anywhere in the text.

A block that does not hold such an object, or is never closed, stays in the content as written.
When there are calls, the content loses its trailing whitespace, and its leading whitespace when
a call comes before any other text (the blank lines models put around their calls).
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
    partial_marker_length,
)

START, END = "<tool_call>", "</tool_call>"


def _parse_block(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    return call_from_json(value, ("arguments", "parameters"))


class HermesToolParser(ToolParser):
    name = "hermes"
    template_markers = ((START,),)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        pieces: list[str | ToolCall] = []  # text outside valid calls, and the calls, in order
        position = 0
        while (start := text.find(START, position)) >= 0:
            pieces.append(text[position:start])
            end = text.find(END, start + len(START))
            block_end = len(text) if end < 0 else end + len(END)
            call = _parse_block(text[start + len(START) : end]) if end >= 0 else None
            pieces.append(call if call is not None else text[start:block_end])
            position = block_end
        pieces.append(text[position:])

        calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        if not calls:
            return ExtractedToolCalls(content, [])
        first_text = next((p for p in pieces if not isinstance(p, str) or p.strip()), None)
        if isinstance(first_text, ToolCall):
            content = content.lstrip()
        return ExtractedToolCalls(content.rstrip() or None, calls)

    def stream(self) -> ToolCallStream:
        return HermesToolCallStream()


class HermesToolCallStream(ToolCallStream):
    """Content goes out as it comes, less a tail that may begin a <tool_call> tag or that is
    whitespace which a following call would drop. A call goes out once its block closes."""

    def __init__(self) -> None:
        super().__init__()
        self._partial = ""  # the end of the text so far, when it may begin a <tool_call> tag
        self._in_block = False
        self._block: list[str] = []  # the open block's body so far, in pieces
        self._block_tail = ""  # its last characters, where a </tool_call> may have begun
        self._held_space = ""  # whitespace after the content sent so far, kept until we know more
        self._sent_content = False

    def feed(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        text, self._partial = self._partial + text, ""
        while text:
            if self._in_block:
                # Search only the new text (and the few characters before it): linear time.
                window = self._block_tail + text
                end = window.find(END)
                if end < 0:
                    self._block.append(text)
                    self._block_tail = window[-(len(END) - 1) :]
                    break
                whole = "".join(self._block) + text
                cut = len(whole) - len(window) + end
                body, text = whole[:cut], whole[cut + len(END) :]
                self._in_block, self._block, self._block_tail = False, [], ""
                call = _parse_block(body)
                if call is None:
                    deltas += self._content(START + body + END)
                else:
                    deltas += self._call_deltas(call)
            else:
                start = text.find(START)
                if start < 0:
                    split = len(text) - partial_marker_length(text, START)
                    deltas += self._content(text[:split])
                    self._partial = text[split:]
                    break
                deltas += self._content(text[:start])
                text = text[start + len(START) :]
                self._in_block = True
        return deltas

    def finish(self) -> list[Delta]:
        if self._in_block:  # never closed: it is content as written
            deltas = self._content(START + "".join(self._block))
        else:
            deltas = self._content(self._partial)
        self._partial, self._in_block, self._block, self._block_tail = "", False, [], ""
        held, self._held_space = self._held_space, ""
        if held and not self.sent_tool_calls:
            deltas.append(ContentDelta(held))
        return deltas

    def _content(self, text: str) -> list[Delta]:
        text = self._held_space + text
        if self.sent_tool_calls and not self._sent_content:
            text = text.lstrip()
        ready = text.rstrip()
        self._held_space = text[len(ready) :]
        if not ready:
            return []
        self._sent_content = True
        return [ContentDelta(ready)]

