"""Request and response bodies of OpenAI's Responses API (`POST /v1/responses`), as far as this
server implements it.

As on the chat route, a request field that is not declared is a 400 naming it. The API's fields
that would change the output and are not implemented (built-in tools, `background`,
`conversation`, ...) are declared and accept only their "off" value (null, false, an
empty list), so a request that asks for them is a 400 that names the field and says why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from roseinfer.server.protocol import MAX_NESTING_DEPTH, StrictModel, nesting_depth_exceeds, now

# Field -> why it is refused when given a value other than its "off" one.
UNSUPPORTED_RESPONSE_FIELDS = {
    "background": "background responses are not supported; leave background out or false",
    "conversation": "conversations are not supported; continue with previous_response_id",
    "include": "no extra output data (include) is available here; leave include out or empty",
    "prompt": "prompt templates are not supported; send input and instructions",
    "max_tool_calls": "max_tool_calls is not supported; use parallel_tool_calls: false for one call",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "context_management": "context management is not supported",
    "moderation": "moderation is not supported",
    "image": "image options are not supported: this server serves text models",
    "access_programs": "access programs are not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported (the prefix cache is automatic)",
    "prompt_cache_options": "prompt_cache_options is not supported (the prefix cache is automatic)",
    "background_options": "background responses are not supported",
}
# Input item types of the API that this server does not take, and content part types.
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "refusal")
# Fields whose values may be any JSON: their nesting is bounded as on the chat route.
_FREE_JSON_FIELDS = ("input", "tools", "text", "metadata")


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    # What an output_text part of an earlier response carries: accepted when fed back, unused.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | Refusal, Field(discriminator="type")]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in _TEXT_PARTS:
                    raise ValueError(f"content[{j}]: {kind!r} parts are not supported (this server serves text "
                                     f"models); use {', '.join(_TEXT_PARTS)}")
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, InputText) else part.refusal for part in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made (fed back as input, or an earlier response's output)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(StrictModel):
    """A call's result, matched to the call by call_id."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """An earlier response's reasoning, fed back: it reaches the chat template as the next
    assistant message's `reasoning_content` (templates such as Qwen3's decide whether to render it)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # nothing here encrypts reasoning, so none can be read back
    status: ItemStatus | None = None

    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in _ITEM_TYPES else "unknown"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: None = None  # OpenAI's verbosity hint: not implemented, so only null

    @field_validator("format")
    @classmethod
    def _json_schema_needs_schema(cls, fmt: TextFormat | None) -> TextFormat | None:
        if fmt is not None and fmt.type == "json_schema" and (fmt.schema_ is None or not fmt.name):
            raise ValueError('type "json_schema" needs name and schema')
        return fmt


class ReasoningConfig(StrictModel):
    """`reasoning` (needs a server started with --reasoning-parser; checked where it is served)."""

    # "none"/"minimal": no thinking (the template's enable_thinking=false); the other levels have
    # nothing to map onto here, so they are refused (thinking_token_budget bounds the thinking).
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; no summary is written

    @field_validator("effort")
    @classmethod
    def _off_only(cls, effort: str | None) -> str | None:
        if effort not in (None, "none", "minimal"):
            raise ValueError(f'effort {effort!r} is not supported: only "none" or "minimal" (no thinking); '
                             "bound the thinking with thinking_token_budget instead")
        return effort

    @property
    def thinking_off(self) -> bool:
        return self.effort in ("none", "minimal")


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad here


def _unsupported_off(name: str, value: Any) -> bool:
    """Whether `value` is the field's "off" value, which is accepted."""
    if name == "include":
        return value in (None, [])
    if name == "background":
        return value in (None, False)
    return value is None


def _string_as_item(value: Any) -> Any:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of input items")
    return value


def _string_or_items(schema: dict[str, Any]) -> None:
    items = dict(schema)
    schema.clear()
    schema["anyOf"] = [{"type": "string"}, items]


class ResponsesRequest(StrictModel):
    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    # A string is one user message. Typed as the list alone (a string is turned into one before
    # validation), so that a bad item is named by its own path, not by the union's members.
    input: Annotated[list[InputItem], Field(min_length=1, json_schema_extra=_string_or_items),
                     BeforeValidator(_string_as_item)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True  # OpenAI's default
    previous_response_id: str | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping the oldest input) is not implemented
    # OpenAI's fields that change nothing here: accepted.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # With --reasoning-parser (else a 400): the thinking's settings; ours, as on the chat route:
    # the most tokens the thinking may take before it is closed.
    reasoning: ReasoningConfig | None = None
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None
    # Refused unless "off" (see UNSUPPORTED_RESPONSE_FIELDS).
    background: bool | None = None
    conversation: Any = None
    include: list[Any] | None = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    background_options: Any = None

    @field_validator(*UNSUPPORTED_RESPONSE_FIELDS, mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if not _unsupported_off(info.field_name, value):
            raise ValueError(f"not supported by this server: {UNSUPPORTED_RESPONSE_FIELDS[info.field_name]}")
        return value

    @field_validator(*_FREE_JSON_FIELDS, mode="before")
    @classmethod
    def _not_nested_too_deep(cls, value: Any) -> Any:
        if nesting_depth_exceeds(value, MAX_NESTING_DEPTH):
            raise ValueError(f"nested more than {MAX_NESTING_DEPTH} levels deep (this server's limit)")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, items: Any) -> Any:
        if isinstance(items, list):
            for i, item in enumerate(items):
                kind = item.get("type") if isinstance(item, dict) else None
                if isinstance(kind, str) and kind not in _ITEM_TYPES:
                    raise ValueError(f"input[{i}]: items of type {kind!r} are not supported by this server "
                                     f"(it takes {', '.join(_ITEM_TYPES)})")
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        if isinstance(tools, list):
            for i, tool in enumerate(tools):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if isinstance(kind, str) and kind != "function":
                    raise ValueError(f"tools[{i}]: the built-in tool {kind!r} is not supported by this server; "
                                     'only tools of type "function"')
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
            raise ValueError(f"tool_choice of type {choice['type']!r} is not supported by this server; use "
                             '"none", "auto", "required" or {"type": "function", "name": ...}')
        return choice

    @field_validator("metadata")
    @classmethod
    def _at_most_16_pairs(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None and len(metadata) > 16:
            raise ValueError(f"at most 16 key-value pairs (OpenAI's limit), got {len(metadata)}")
        return metadata


# -- responses ------------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction
    tools: list[FunctionTool]
    text: TextConfig
    truncation: Literal["disabled"] = "disabled"
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response; its other fields depend on `type` (see
    OpenAI's Responses streaming events)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
