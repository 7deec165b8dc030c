"""Request and response bodies of Anthropic's Messages API (POST /v1/messages and
/v1/messages/count_tokens), its streamed events, and its error object.

Every request model names what it does not take: a field Anthropic defines that would change the
output and that this server does not implement (`UNSUPPORTED`), or one Anthropic does not define
here, is a 400 naming it. Fields that change nothing here (`metadata`, `cache_control`,
`service_tier`) are declared and accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from roseinfer.server.protocol import MAX_NESTING_DEPTH, nesting_depth_exceeds


class AnthropicRequestModel(BaseModel):
    """A request object: a field it does not declare is a 400 that names it (and says why, where
    `UNSUPPORTED` knows), in Anthropic's terms rather than pydantic's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    UNSUPPORTED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = {field.alias or name for name, field in cls.model_fields.items()}
            for name in data:
                if name in cls.UNSUPPORTED:
                    raise ValueError(f"{name}: not supported by this server: {cls.UNSUPPORTED[name]}")
                if name not in known:
                    raise ValueError(f"unknown field {name!r}: Anthropic's Messages API does not define it "
                                     "here (see the README for the accepted fields)")
        return data


class CacheControl(AnthropicRequestModel):
    """A prompt-caching hint: accepted and changes nothing (the prefix cache here is automatic)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(AnthropicRequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # what a client echoes back of a response's text block (never filled here)


CONTENT_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")
_TEXT_BLOCKS = TypeAdapter(list[TextBlock])


def _blocks(adapter: TypeAdapter, value: Any) -> Any:
    """A list of content blocks validated on its own, so that a bad block is named in the error
    (where a field that takes a string or blocks would report the string's mismatch first)."""
    if not isinstance(value, list):
        return value
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        location = list(error["loc"])
        if len(location) > 1 and location[1] in CONTENT_BLOCK_TYPES:  # the union's tag, not a field
            del location[1]
        where = f"block {location[0]}" + "".join(f".{part}" for part in location[1:])
        raise ValueError(f"{where}: {error['msg'].removeprefix('Value error, ')}") from None


class ToolUseBlock(AnthropicRequestModel):
    """A tool call the assistant made earlier in the conversation."""

    UNSUPPORTED: ClassVar[dict[str, str]] = {"caller": "programmatic tool calling is not supported"}

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    toolset_name: None = None


class ToolResultBlock(AnthropicRequestModel):
    """The result of a tool call, sent back in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_blocks(cls, content: Any) -> Any:
        return _blocks(_TEXT_BLOCKS, content)

    def text(self) -> str:
        # Blocks are joined by lines, as the chat route joins a message's text parts.
        return self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)


class ThinkingBlock(AnthropicRequestModel):
    """The assistant's earlier thinking, sent back in the conversation (the chat template decides
    whether it is rendered: it reaches the template as the message's `reasoning_content`)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]
_CONTENT_BLOCKS = TypeAdapter(list[ContentBlock])


class InputMessage(AnthropicRequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_block_types(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, block in enumerate(content):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in CONTENT_BLOCK_TYPES:
                    raise ValueError(f"block {i}: content blocks of type {kind!r} are not supported by this "
                                     f"server (it takes {', '.join(CONTENT_BLOCK_TYPES)})")
        return _blocks(_CONTENT_BLOCKS, content)

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> InputMessage:
        allowed = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}[self.role]
        for i, block in enumerate(self.content if isinstance(self.content, list) else []):
            if block.type not in allowed:
                raise ValueError(f"content block {i}: a {self.role} message cannot hold a {block.type} block")
        return self


class Tool(AnthropicRequestModel):
    """A client tool: the model calls it, the client runs it and sends the result back."""

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "input_examples": "tool input examples are not supported",
        "defer_loading": "tool search (defer_loading) is not supported",
        "allowed_callers": "programmatic tool calling is not supported",
        "eager_input_streaming": "not supported; tool input streams as it is generated anyway",
    }

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"tools of type {data.get('type')!r} (server tools) are not supported by this "
                             "server; only client tools (with name and input_schema) are")
        return data


class ToolChoiceAuto(AnthropicRequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(AnthropicRequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(AnthropicRequestModel):
    type: Literal["tool"]
    name: Annotated[str, Field(min_length=1)]
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(AnthropicRequestModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingDisabled(AnthropicRequestModel):
    type: Literal["disabled"]


class ThinkingEnabled(AnthropicRequestModel):
    """Extended thinking: with --reasoning-parser, `budget_tokens` becomes the request's
    thinking_token_budget (the thinking is closed after that many tokens). Anthropic's minimum of
    1024 is not enforced: small models think in fewer."""

    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=0)]


class JsonOutputFormat(AnthropicRequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicRequestModel):
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "effort": "effort is not supported; with --reasoning-parser, bound the thinking with thinking.budget_tokens"}

    format: JsonOutputFormat | None = None


class Metadata(AnthropicRequestModel):
    user_id: str | None = None


THINKING_NEEDS_PARSER = ('thinking: enabled thinking needs a server started with --reasoning-parser, which this '
                         'one was not; leave thinking out or send {"type": "disabled"}')
_ADAPTIVE = ('thinking of type "adaptive" is not supported; send {"type": "enabled", "budget_tokens": N} '
             '(with a server started with --reasoning-parser) or {"type": "disabled"}')
# Fields Anthropic defines that would change the output and are not implemented: field -> why.
UNSUPPORTED_FIELDS = {
    "container": "code-execution containers are not supported",
    "mcp_servers": "MCP servers are not supported; give client tools",
    "context_management": "context management is not supported",
    "diagnostics": "diagnostics are not supported",
    "inference_geo": "not supported; leave inference_geo out",
    "speed": "not supported; leave speed out",
}


class CountTokensRequest(AnthropicRequestModel):
    """What the prompt is made of (the Messages request without its sampling fields)."""

    UNSUPPORTED: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    @field_validator("messages", "tools", "system", "output_config", mode="before")
    @classmethod
    def _not_nested_too_deep(cls, value: Any) -> Any:
        if nesting_depth_exceeds(value, MAX_NESTING_DEPTH):
            raise ValueError(f"nested more than {MAX_NESTING_DEPTH} levels deep (this server's limit)")
        return value

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[ThinkingDisabled | ThinkingEnabled, Field(discriminator="type")] | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, system: Any) -> Any:
        return _blocks(_TEXT_BLOCKS, system)

    @field_validator("thinking", mode="before")
    @classmethod
    def _thinking_not_adaptive(cls, value: Any) -> Any:
        # "enabled" is checked against the server (a reasoning parser) where the request is served.
        if isinstance(value, dict) and value.get("type") == "adaptive":
            raise ValueError(_ADAPTIVE)
        return value

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)  # as the chat route joins text parts


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0: no top-k
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


# -- responses -------------------------------------------------------------------------------

class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    """The model's thinking (a reasoning parser's split). Nothing here signs it: the signature is
    empty, and a thinking block sent back is read whatever its signature."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


OutputContent = Annotated[TextContent | ToolUseContent | ThinkingContent, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputContent]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


# -- streamed events (each sent as `event: <type>` and `data: <the event>`) --------------------

class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputContent


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | InputJsonDelta | ThinkingDelta, Field(discriminator="type")]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# -- errors ----------------------------------------------------------------------------------

class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


STREAM_EVENTS: list[type[BaseModel]] = [
    MessageStartEvent, ContentBlockStartEvent, PingEvent, ContentBlockDeltaEvent, ContentBlockStopEvent,
    MessageDeltaEvent, MessageStopEvent, AnthropicErrorResponse,
]
