"""What a chat request's `tools` and `tool_choice` ask of a response, as OpenAI defines them:

    "none"        the tools reach the chat template, the answer is plain content
    "auto"        the model's own tool-call format, parsed by the server's tool-call parser (the one
                  its chat template writes, or --tool-call-parser); a template without a tool-call
                  format answers in text
    "required"    the output is grammar-constrained to a JSON array of calls of the given tools
    {"function"}  the output is grammar-constrained to that function's arguments

and the response's content and tool calls, whole or as streaming deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from roseinfer.errors import InvalidRequestError
from roseinfer.server.protocol import ChatCompletionRequest, NamedToolChoice
from roseinfer.structured_output import StructuredOutputsParams
from roseinfer.tool_parsers import (
    ExtractedToolCalls,
    NamedToolCallStream,
    RequiredToolCallStream,
    ToolCallStream,
    ToolParser,
    extract_named_tool_call,
    extract_required_tool_calls,
    get_tool_parser,
    named_tool_schema,
    required_tool_calls_schema,
)


@dataclass
class ToolCalling:
    mode: str  # "auto" | "required" | "named"
    function_name: str | None = None  # "named"
    parser: ToolParser | None = None  # "auto"
    structured_outputs: StructuredOutputsParams | None = None  # "required" | "named"

    def extract(self, text: str) -> ExtractedToolCalls:
        if self.mode == "required":
            return extract_required_tool_calls(text)
        if self.mode == "named":
            return extract_named_tool_call(text, self.function_name)
        return self.parser.extract_tool_calls(text)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the response must keep special tokens (the format's markers are some)."""
        return self.parser is not None and self.parser.keeps_special_tokens

    def stream(self) -> ToolCallStream:
        if self.mode == "required":
            return RequiredToolCallStream()
        if self.mode == "named":
            return NamedToolCallStream(self.function_name)
        return self.parser.stream()


def tool_calling_for(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolCalling | None:
    """How the response to `body` carries tool calls (None: it does not)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None:
            raise InvalidRequestError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return None
    if choice == "auto":
        if tool_call_parser is None:
            return None  # no tool-call format known for this model: the answer is text
        return ToolCalling("auto", parser=get_tool_parser(tool_call_parser, tools))
    if choice == "required":
        schema = required_tool_calls_schema(tools)
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolCalling("required", structured_outputs=_constraint(schema))
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in {tool["function"]["name"] for tool in tools}:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return ToolCalling("named", function_name=name, structured_outputs=_constraint(named_tool_schema(tools, name)))


def _constraint(schema: dict) -> StructuredOutputsParams:
    params = StructuredOutputsParams(json=schema)
    params.param = "tools"  # a schema llguidance rejects comes from the tools' parameters
    return params
