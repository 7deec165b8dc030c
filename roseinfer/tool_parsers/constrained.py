"""tool_choice "required" and a named function, made certain with a grammar: the JSON Schema that
constrains the output to the tools' parameter schemas, and the constrained output turned back
into tool calls (whole, or as streaming deltas).

"required": a JSON array of at least one {"name": <a tool's name>, "parameters": <its arguments>}.
A named function: the output is that function's arguments object itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from roseinfer.errors import InvalidRequestError
from roseinfer.tool_parsers.base import (
    ContentDelta,
    Delta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    call_from_json,
    make_tool_call_id,
)

# A function that declares no parameters takes an object of any shape.
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def function_parameters(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each function's name -> its parameters schema, from OpenAI `tools`; a 400 naming the
    entry when one is not {"type": "function", "function": {"name": ..., ...}}."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise InvalidRequestError("tools must be a non-empty list", param="tools")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidRequestError(f'tools[{i}] must have type "function"', param=f"tools[{i}]")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"tools[{i}].function.name must be a non-empty string", param=f"tools[{i}].function"
            )
        if name in schemas:
            raise InvalidRequestError(
                f"tools[{i}]: two functions are named {name!r}", param=f"tools[{i}].function.name"
            )
        parameters = function.get("parameters")
        if parameters is None:
            parameters = _ANY_OBJECT
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(
                f"tools[{i}].function.parameters must be a JSON Schema object",
                param=f"tools[{i}].function.parameters",
            )
        schemas[name] = dict(parameters)
    return schemas


def required_tool_calls_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The schema of tool_choice "required": one or more calls of the given tools."""
    calls, definitions = [], {}
    for i, (name, parameters) in enumerate(function_parameters(tools).items()):
        if _has_local_refs(parameters):
            # Its "#/..." references point into its own schema: keep that schema whole under
            # the root's $defs and point the references there.
            definitions[f"tool_{i}"] = _moved_refs(parameters, f"#/$defs/tool_{i}")
            parameters = {"$ref": f"#/$defs/tool_{i}"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if definitions:
        schema["$defs"] = definitions
    return schema


def _has_local_refs(value: Any) -> bool:
    if isinstance(value, Mapping):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_refs(child) for child in value.values())
    if isinstance(value, list):
        return any(_has_local_refs(child) for child in value)
    return False


def _moved_refs(value: Any, root: str) -> Any:
    """A copy of `value` in which every "#..." reference starts at `root` instead."""
    if isinstance(value, list):
        return [_moved_refs(child, root) for child in value]
    if not isinstance(value, Mapping):
        return value
    moved = {}
    for key, child in value.items():
        if key == "$ref" and isinstance(child, str) and child.startswith("#"):
            moved[key] = root + child[1:]
        else:
            moved[key] = _moved_refs(child, root)
    return moved


def named_tool_schema(tools: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """The schema of tool_choice {"type": "function", "function": {"name": name}}: that
    function's arguments."""
    schemas = function_parameters(tools)
    if name not in schemas:
        raise InvalidRequestError(
            f"tool_choice names function {name!r}, which is not in tools "
            f"(tools: {', '.join(schemas)})",
            param="tool_choice",
        )
    return schemas[name]


def extract_required_tool_calls(text: str) -> ExtractedToolCalls:
    """The calls in a "required" response; text that is not a complete array of calls (cut off
    by max_tokens, say) comes back as content."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return ExtractedToolCalls(text, [])
    calls = [call_from_json(item, ("parameters",)) for item in value] if isinstance(value, list) else []
    if not calls or any(call is None for call in calls):
        return ExtractedToolCalls(text, [])
    return ExtractedToolCalls(None, calls)


def extract_named_tool_call(text: str, name: str) -> ExtractedToolCalls:
    """The call in a named-function response: the text is its arguments."""
    return ExtractedToolCalls(None, [ToolCall(name=name, arguments=text)])


class RequiredToolCallStream(ToolCallStream):
    """Holds a "required" response and sends its calls once it has ended."""

    def __init__(self) -> None:
        super().__init__()
        self._pieces: list[str] = []

    def feed(self, text: str) -> list[Delta]:
        self._pieces.append(text)
        return []

    def finish(self) -> list[Delta]:
        content, calls = extract_required_tool_calls("".join(self._pieces))
        if content is not None:
            return [ContentDelta(content)] if content else []
        return [delta for call in calls for delta in self._call_deltas(call)]


class NamedToolCallStream(ToolCallStream):
    """A named-function response streams as the arguments of its one call, as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        if not self.sent_tool_calls:
            self._calls_sent = 1
            deltas.append(ToolCallDelta(0, id=make_tool_call_id(), name=self._name))
        if text:
            deltas.append(ToolCallDelta(0, arguments=text))
        return deltas

    def finish(self) -> list[Delta]:
        return self.feed("")
