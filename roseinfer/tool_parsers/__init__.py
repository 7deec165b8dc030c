"""Tool calling: parsers for the formats models write their calls in (one module each), found from
the model's chat template (`detect_tool_parser`) or chosen by name (`--tool-call-parser`), and the
grammar-constrained tool_choice "required" / named function."""

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
from roseinfer.tool_parsers.detect import KNOWN_WITHOUT_PARSER, detect_tool_format
from roseinfer.tool_parsers.harmony import HarmonyToolParser
from roseinfer.tool_parsers.hermes import HermesToolParser
from roseinfer.tool_parsers.llama3_json import Llama3JsonToolParser
from roseinfer.tool_parsers.mistral import MistralToolParser
from roseinfer.tool_parsers.qwen3_coder import Qwen3CoderToolParser

# A new format: a module with its ToolParser, and its class here (gpt-oss's harmony goes here too,
# and leaves detect.KNOWN_WITHOUT_PARSER).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3CoderToolParser,
                   HarmonyToolParser)
}


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """The parser registered under `name` (see TOOL_PARSERS), for a request with these tools."""
    try:
        return TOOL_PARSERS[name](tools)
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r} (available: {', '.join(sorted(TOOL_PARSERS))})"
        ) from None


def detect_tool_parser(chat_template: str | None) -> tuple[str | None, str]:
    """(the registered parser for the tool-call format `chat_template` writes, or None; a line
    that says what was found, for the server's log)."""
    found = detect_tool_format(chat_template, TOOL_PARSERS)
    if found in TOOL_PARSERS:
        return found, f"tool calls: the chat template writes the {found} format"
    if found is not None:
        return None, (f"tool calls: the chat template writes the {found} format, which has no parser here; "
                      'tool_choice "auto" answers in text ("required" and named functions still work)')
    return None, ('tool calls: the chat template has no tool-call format; tool_choice "auto" answers in text '
                  '(--tool-call-parser names one)')


__all__ = [
    "KNOWN_WITHOUT_PARSER",
    "TOOL_PARSERS",
    "ContentDelta",
    "Delta",
    "ExtractedToolCalls",
    "HarmonyToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "Qwen3CoderToolParser",
    "NamedToolCallStream",
    "RequiredToolCallStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "extract_named_tool_call",
    "detect_tool_format",
    "detect_tool_parser",
    "extract_required_tool_calls",
    "function_parameters",
    "get_tool_parser",
    "make_tool_call_id",
    "named_tool_schema",
    "required_tool_calls_schema",
]
