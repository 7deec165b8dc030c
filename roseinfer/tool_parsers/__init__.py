"""Tool calling: parsers for the formats models write their calls in, chosen by name
(`--tool-call-parser`), and the grammar-constrained tool_choice "required" / named function."""

from __future__ import annotations

from roseinfer.tool_parsers.base import (
    ContentDelta,
    Delta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    make_tool_call_id,
)
from roseinfer.tool_parsers.constrained import (
    NamedToolCallStream,
    RequiredToolCallStream,
    extract_named_tool_call,
    extract_required_tool_calls,
    function_parameters,
    named_tool_schema,
    required_tool_calls_schema,
)
from roseinfer.tool_parsers.hermes import HermesToolParser
from roseinfer.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name` (see TOOL_PARSERS)."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r} (available: {', '.join(sorted(TOOL_PARSERS))})"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "Delta",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NamedToolCallStream",
    "RequiredToolCallStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "extract_named_tool_call",
    "extract_required_tool_calls",
    "function_parameters",
    "get_tool_parser",
    "make_tool_call_id",
    "named_tool_schema",
    "required_tool_calls_schema",
]
