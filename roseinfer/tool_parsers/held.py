"""A streaming extractor for formats whose calls come after a marker and are read whole: the text
before the marker streams as content; from the marker on it is held, and read by the parser's
extract_tool_calls once the response has ended (the whole text then gives the same content and
calls as the parser does)."""

from __future__ import annotations

from roseinfer.tool_parsers.base import (
    ContentDelta,
    Delta,
    ToolCallStream,
    ToolParser,
    partial_marker_length,
)


class HeldAfterMarkerStream(ToolCallStream):
    def __init__(self, parser: ToolParser, marker: str) -> None:
        super().__init__()
        self._parser, self._marker = parser, marker
        self._sent = ""  # content already sent
        self._space = ""  # whitespace after it, held: the parser drops it before a call
        self._held = ""  # from the marker on (or, before it is found, what may begin one)
        self._found = False

    def feed(self, text: str) -> list[Delta]:
        if self._found:
            self._held += text
            return []
        text, self._held = self._held + text, ""
        start = text.find(self._marker)
        if start >= 0:
            self._found, self._held = True, text[start:]
            return self._content(text[:start])
        split = len(text) - partial_marker_length(text, self._marker)
        self._held = text[split:]
        return self._content(text[:split])

    def finish(self) -> list[Delta]:
        held, self._held = self._held, ""
        whole = self._sent + self._space + held
        content, calls = self._parser.extract_tool_calls(whole) if self._found else (None, [])
        if not calls:
            rest, self._space = self._space + held, ""
            return [ContentDelta(rest)] if rest else []
        # The parser may trim the content it reads; only what was not sent yet goes out.
        content = content or ""
        rest = content[len(self._sent):] if content.startswith(self._sent) else ""
        deltas: list[Delta] = [ContentDelta(rest)] if rest else []
        return deltas + [delta for call in calls for delta in self._call_deltas(call)]

    def _content(self, text: str) -> list[Delta]:
        text = self._space + text
        ready = text.rstrip()
        self._space = text[len(ready):]
        if not ready:
            return []
        self._sent += ready
        return [ContentDelta(ready)]

