"""What every tool-call parser gives back: tool calls with OpenAI-style ids, the text that was not
a call, and, while streaming, OpenAI-shaped deltas (content pieces and tool-call pieces)."""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple


def make_tool_call_id() -> str:
    """An id like OpenAI's: "call_" and 24 random letters and digits."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass
class ToolCall:
    """A function call; `arguments` is JSON text, as the OpenAI API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ExtractedToolCalls(NamedTuple):
    """`content` is the text outside the calls (None when there is none)."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallDelta:
    """A piece of the tool call at `index`: its first piece carries id and name, the later ones
    pieces of the arguments text, which add up to the call's full arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            delta.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        delta["function"] = function
        return delta


Delta = ContentDelta | ToolCallDelta


class ToolCallStream(ABC):
    """Turns one response's text, fed as it is generated, into deltas. Feeding the whole text
    and then `finish()` gives the same content and calls as the parser's extract_tool_calls."""

    def __init__(self) -> None:
        self._calls_sent = 0

    @abstractmethod
    def feed(self, text: str) -> list[Delta]:
        """Deltas for the text generated since the last call."""

    @abstractmethod
    def finish(self) -> list[Delta]:
        """Deltas for what was held back, once the response has ended."""

    @property
    def sent_tool_calls(self) -> bool:
        """Whether any tool call went out (the response then finishes with "tool_calls")."""
        return self._calls_sent > 0

    def _call_deltas(self, call: ToolCall) -> list[Delta]:
        index = self._calls_sent
        self._calls_sent += 1
        return [
            ToolCallDelta(index, id=call.id, name=call.name),
            ToolCallDelta(index, arguments=call.arguments),
        ]


class ToolParser(ABC):
    """Finds the tool calls a model wrote in its own format (one per response; `tools`: the
    request's OpenAI function tools, for formats that need their schemas to type arguments)."""

    name: ClassVar[str]
    # How a chat template that writes this format is recognised: any one group of strings that
    # all appear in it (see detect.py; the most specific match wins).
    template_markers: ClassVar[tuple[tuple[str, ...], ...]] = ()
    # Whether the format's markers are special tokens, which the response must then keep.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def parameter_schema(self, function: str, parameter: str) -> dict[str, Any]:
        """The JSON Schema of a function's parameter in the request's tools ({} if not given)."""
        for tool in self.tools:
            spec = tool.get("function", {})
            if spec.get("name") == function:
                schema = ((spec.get("parameters") or {}).get("properties") or {}).get(parameter)
                return schema if isinstance(schema, dict) else {}
        return {}

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole response; malformed calls stay in the content."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh streaming extractor for one response."""


def call_from_json(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., <one of arguments_keys>: {...}} object, or None
    when it is not one. Arguments written as JSON text count if they decode to an object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    present = [key for key in arguments_keys if key in value]
    if len(present) != 1:
        return None
    arguments = value[present[0]]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def partial_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the beginning of `marker` (held back
    while streaming until the next piece tells)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
