"""Request and response bodies of Anthropic's Messages API (POST /v1/messages and
/v1/messages/count_tokens), its streamed events, and its error object.

Every request model names what it does not take: a field Anthropic defines that would change the
output and that this server does not implement (`UNSUPPORTED`), or one Anthropic does not define
here, is a 400 naming it. Fields that change nothing here (`metadata`, `cache_control`,
`service_tier`) are declared and accepted, and so are the hints a gateway may ignore, which agents
such as Claude Code send on every request (`context_management`, `output_config.effort` and
`task_budget`, adaptive thinking): `ignored_fields()` names those this server does not act on, for
a log line once per client (see ignored_fields.py).
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

from roseinfer.server.protocol import bounded_nesting, kinds_checked


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


class CacheControl(BaseModel):
    """A prompt-caching hint: accepted whatever it holds (ttl, scope, ...), and changes nothing
    (the prefix cache here is automatic)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["ephemeral"]


class TextBlock(AnthropicRequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    # What a client echoes back of a response's text block (never filled here, so only empty).
    citations: Annotated[list[Any], Field(max_length=0)] | None = None


class Base64ImageSource(AnthropicRequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: Annotated[str, Field(min_length=1)]


class URLImageSource(AnthropicRequestModel):
    """Fetched only from the hosts the operator allows (--allowed-media-domains)."""

    type: Literal["url"]
    url: Annotated[str, Field(min_length=1)]


class ImageBlock(AnthropicRequestModel):
    """An image in a user turn (a vision-language model; a text model refuses it, naming the block)."""

    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    @field_validator("source", mode="before")
    @classmethod
    def _no_files(cls, source: Any) -> Any:
        if isinstance(source, dict) and source.get("type") == "file":
            raise ValueError("an image source of type 'file' (the Files API) is not supported by this server; "
                             "send the image as base64 or a URL")
        return source

    def url(self) -> str:
        """The image as the chat route's image_url takes it: a data URL, or the URL as sent."""
        if isinstance(self.source, Base64ImageSource):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        return self.source.url


CONTENT_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking")
# Blocks of Anthropic's API that hold media this server cannot read: refused by name.
MEDIA_BLOCK_TYPES = ("image", "document", "search_result")
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
        if len(location) > 1 and location[1] in (*CONTENT_BLOCK_TYPES, "tool_reference"):  # the union's tag
            del location[1]
        where = f"block {location[0]}" + "".join(f".{part}" for part in location[1:])
        raise ValueError(f"{where}: {error['msg'].removeprefix('Value error, ')}") from None


class DirectCaller(AnthropicRequestModel):
    """Who called a tool: the model itself ("direct", the default, what the official SDK echoes
    back); a code-execution caller (programmatic tool calling) is not supported."""

    type: Literal["direct"]


class ToolUseBlock(AnthropicRequestModel):
    """A tool call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    toolset_name: None = None
    caller: DirectCaller | None = None

    @field_validator("caller", mode="before")
    @classmethod
    def _direct_only(cls, caller: Any) -> Any:
        if isinstance(caller, dict) and caller.get("type") != "direct":
            raise ValueError("programmatic tool calling is not supported: a tool_use block's caller can only be "
                             '{"type": "direct"} or null')
        return caller


class ToolReferenceBlock(AnthropicRequestModel):
    """A tool that a client-side tool search found (Claude Code's ToolSearch answers with these):
    the API loads that tool's definition; here every tool is in the prompt already (see
    Tool.defer_loading), so the result reads as the tool's name."""

    type: Literal["tool_reference"]
    tool_name: Annotated[str, Field(min_length=1)]
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        return self.tool_name


_RESULT_BLOCKS = TypeAdapter(list[Annotated[TextBlock | ToolReferenceBlock, Field(discriminator="type")]])


class ToolResultBlock(AnthropicRequestModel):
    """The result of a tool call, sent back in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock | ToolReferenceBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: None = None

    _text_blocks = kinds_checked("content", ("text", "tool_reference"), "content blocks", "block {i}",
                                 media=MEDIA_BLOCK_TYPES, why="a tool result reaches this model as text only",
                                 then=lambda content: _blocks(_RESULT_BLOCKS, content))

    def text(self) -> str:
        # Blocks are joined by lines, as the chat route joins a message's text parts.
        return self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)


class ThinkingBlock(AnthropicRequestModel):
    """The assistant's earlier thinking, sent back in the conversation (the chat template decides
    whether it is rendered: it reaches the template as the message's `reasoning_content`)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                        Field(discriminator="type")]
_CONTENT_BLOCKS = TypeAdapter(list[ContentBlock])


class InputMessage(AnthropicRequestModel):
    # "system": an instruction in the middle of the conversation (Claude Code sends them); the
    # chat template places it where it can (see chat_template.render_chat_template).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    _known_block_types = kinds_checked("content", CONTENT_BLOCK_TYPES, "content blocks", "block {i}",
                                       media=MEDIA_BLOCK_TYPES, why="this server reads text and images only",
                                       then=lambda content: _blocks(_CONTENT_BLOCKS, content))

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> InputMessage:
        allowed = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use", "thinking"),
                   "system": ("text",)}[self.role]
        for i, block in enumerate(self.content if isinstance(self.content, list) else []):
            if block.type not in allowed:
                raise ValueError(f"content block {i}: a {self.role} message cannot hold a {block.type} block")
        return self


class Tool(AnthropicRequestModel):
    """A client tool: the model calls it, the client runs it and sends the result back."""

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "input_examples": "tool input examples are not supported",
        "allowed_callers": "programmatic tool calling is not supported",
        "eager_input_streaming": "not supported; tool input streams as it is generated anyway",
    }

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None
    # Tool search's "load this tool only once searched for" (Claude Code marks tools so): every
    # tool is loaded up front here, which is what such a client sends when a server refuses it.
    defer_loading: bool | None = None

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
    display: str | None = None  # how the thinking is shown ("summarized", ...): it is shown whole here


class ThinkingAdaptive(AnthropicRequestModel):
    """The model decides how much to think: with --reasoning-parser, bounded by
    `output_config.effort` (see effort.py); without one, nothing to decide."""

    type: Literal["adaptive"]
    display: str | None = None


class JsonOutputFormat(AnthropicRequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicRequestModel):
    format: JsonOutputFormat | None = None
    # How hard to think: with --reasoning-parser a thinking budget (effort.py), else ignored.
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    # Claude Code's hints about the agent's remaining budget and its timing: nothing reads them here.
    task_budget: Any = None
    timing: Any = None


class Metadata(BaseModel):
    """Client bookkeeping (user_id, and what else a client sends): accepted, unused."""

    model_config = ConfigDict(extra="allow")

    user_id: str | None = None


# Fields Anthropic defines that would change the output and are not implemented: field -> why.
UNSUPPORTED_FIELDS = {
    "container": "code-execution containers are not supported",
    "mcp_servers": "MCP servers are not supported; give client tools",
    "diagnostics": "diagnostics are not supported",
    "inference_geo": "not supported; leave inference_geo out",
    "speed": "not supported; leave speed out",
}


class CountTokensRequest(AnthropicRequestModel):
    """What the prompt is made of (the Messages request without its sampling fields)."""

    UNSUPPORTED: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    _bounded = bounded_nesting("messages", "tools", "system", "output_config", "context_management",
                               "structured_outputs")

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[ThinkingDisabled | ThinkingEnabled | ThinkingAdaptive, Field(discriminator="type")] | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    # Server-side context editing (clearing old tool results, compaction): a gateway may leave it
    # to the client, which still holds the whole conversation; ignored here.
    context_management: dict[str, Any] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, system: Any) -> Any:
        return _blocks(_TEXT_BLOCKS, system)

    def ignored_fields(self, reasoning: bool) -> dict[str, str]:
        """The fields given that change nothing on this server (`reasoning`: it has a reasoning
        parser, so thinking settings are honoured): field -> why."""
        ignored = {}
        if self.context_management is not None:
            ignored["context_management"] = "context is not edited server-side; the client's conversation is used as sent"
        config = self.output_config
        if config is not None and (config.task_budget is not None or config.timing is not None):
            ignored["output_config.task_budget"] = "no budget hints are given to the model"
        if any(tool.defer_loading for tool in self.tools or ()):
            ignored["tools.defer_loading"] = "no tool search here: every tool is in the prompt from the start"
        if not reasoning and self.thinking is not None and not isinstance(self.thinking, ThinkingDisabled):
            ignored["thinking"] = "the model does not think (no --reasoning-parser)"
        if not reasoning and config is not None and config.effort is not None:
            ignored["output_config.effort"] = "the model does not think (no --reasoning-parser)"
        return ignored

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(block.text for block in self.system)  # as the chat route joins text parts


class MessagesRequest(CountTokensRequest):
    # Cut to what fits the context after the prompt (Anthropic's newer models do the same).
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0: no top-k
    metadata: Metadata | None = None
    service_tier: str | None = None  # accepted; there is one tier here
    # Ours, as on the chat route (vLLM's): a constraint by json, regex, choice or grammar (Lark or
    # GBNF), which output_config.format's JSON schemas cannot say.
    structured_outputs: dict[str, Any] | None = None


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
    """As Anthropic counts them: `input_tokens` are the prompt tokens computed for this request,
    `cache_read_input_tokens` those found in the prefix cache (an agent's earlier turns), so the
    prompt is their sum. Nothing is written to a cache on request here (cache_control is a hint;
    the prefix cache fills itself), so cache_creation_input_tokens is 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


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
