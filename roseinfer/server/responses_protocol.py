"""Request and response bodies of OpenAI's Responses API (`POST /v1/responses`), as far as this
server implements it.

As on the chat route, a request field that is not declared is a 400 naming it. The API's fields
that would change the output and are not implemented (built-in tools, `background`,
`conversation`, ...) are declared and accept only their "off" value (null, false, an
empty list), so a request that asks for them is a 400 that names the field and says why.
What agents such as Codex send and a server may leave unfilled (`client_metadata`, `include`
entries, `reasoning.summary`, `text.verbosity`) is accepted, and `ignored_fields()` names it for a
log line once per client; a `namespace` tool (a group of function tools) is flattened to its
functions, whose calls come back with the namespace named.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from roseinfer.server.effort import Effort
from roseinfer.server.protocol import (
    StrictModel,
    bounded_nesting,
    kinds_checked,
    known_kinds,
    now,
)

# Field -> why it is refused when given a value other than its "off" one.
UNSUPPORTED_RESPONSE_FIELDS = {
    "background": "background responses are not supported; leave background out or false",
    "conversation": "conversations are not supported; continue with previous_response_id",
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
_TEXT_PARTS = ("input_text", "output_text", "refusal", "input_image")
# Fields whose values may be any JSON: their nesting is bounded as on the chat route.
_FREE_JSON_FIELDS = ("input", "tools", "text", "metadata", "client_metadata", "structured_outputs")
_MEDIA_PARTS = ("input_file", "input_audio")


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    # What an output_text part of an earlier response carries: accepted when fed back, unused.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(StrictModel):
    """An image in a message (a vision-language model; a text model refuses it, naming the part)."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1)] | None = None  # a data URL, or http(s) from --allowed-media-domains
    file_id: None = None  # the Files API: refused by _no_files
    # OpenAI's resolution hint: the model's own processor decides here (logged as ignored otherwise).
    detail: Literal["auto", "low", "high", "original"] | None = None

    @staticmethod
    def check_source(part: dict[str, Any], where: str) -> None:
        """Checked before the part's own validation, so the error names the part and says why."""
        if part.get("file_id") is not None:
            raise ValueError(f"{where}: an input_image's file_id is not supported by this server (it has no "
                             "Files API); send the image as image_url, a data URL")
        if part.get("image_url") is None:
            raise ValueError(f"{where}: an input_image needs image_url (a data URL, or an http(s) URL the "
                             "server allows)")


ContentPart = Annotated[InputText | Refusal | InputImage, Field(discriminator="type")]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _image_sources_checked(content: Any) -> Any:
    """A message's `input_image` parts each name one source we can read (InputImage.check_source)."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "input_image":
                InputImage.check_source(part, f"content[{i}]")
    return content


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    _text_parts_only = kinds_checked("content", _TEXT_PARTS, "parts", "content[{i}]", media=_MEDIA_PARTS,
                                     why="this server reads text and images only",
                                     then=lambda content: _image_sources_checked(content))

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, InputText) else part.refusal
                       for part in self.content if not isinstance(part, InputImage))


class FunctionCallItem(StrictModel):
    """A call the model made (fed back as input, or an earlier response's output)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None  # the namespace tool the function came from


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
    # Nothing here encrypts reasoning, so none is written; one a client echoes back (from another
    # server) cannot be read, and is dropped.
    encrypted_content: str | None = None
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
    defer_loading: bool | None = None  # a hint for OpenAI's tool search: every tool is loaded here
    namespace: str | None = None  # set when flattened out of a namespace tool (not a request field)


# Tools the model cannot be given here: OpenAI's hosted tools (run by OpenAI's servers) and
# freeform "custom" tools (their input is constrained by a grammar this server does not take). An
# agent sends them with its function tools by default (Codex: web_search, apply_patch): they are
# left out, so the model answers with the tools it can call, and the route logs them once.
UNAVAILABLE_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                     "computer_use_preview", "computer", "mcp", "local_shell", "shell", "apply_patch", "custom",
                     "tool_search")


def _flattened_tools(tools: list[Any], dropped: list[str]) -> list[Any]:
    """`tools` with each {"type": "namespace", "name", "description", "tools": [...]} replaced by
    its function tools, each remembering its namespace; UNAVAILABLE_TOOLS left out (named in
    `dropped`)."""
    flat = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in UNAVAILABLE_TOOLS:
            dropped.append(f"{kind} tool {tool.get('name')!r}" if tool.get("name") else f"{kind} tool")
        elif kind != "namespace":
            flat.append(tool)
        else:
            inner, name = tool.get("tools"), tool.get("name")
            if not isinstance(inner, list) or not isinstance(name, str) or not name:
                raise ValueError(f"tools[{i}]: a namespace tool needs a name and a list of tools")
            known_kinds(inner, ("function",), "tools", f"tools[{i}].tools[{{i}}]", also=UNAVAILABLE_TOOLS)
            dropped += [f"{child['type']} tool {name}.{child.get('name')}" for child in inner
                        if child.get("type") in UNAVAILABLE_TOOLS]
            flat += [{**child, "namespace": name} for child in inner if child.get("type") == "function"]
    return flat


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
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: not acted on (logged once)

    @field_validator("format")
    @classmethod
    def _json_schema_needs_schema(cls, fmt: TextFormat | None) -> TextFormat | None:
        if fmt is not None and fmt.type == "json_schema" and (fmt.schema_ is None or not fmt.name):
            raise ValueError('type "json_schema" needs name and schema')
        return fmt


class ReasoningConfig(StrictModel):
    """`reasoning`: with --reasoning-parser the effort is a thinking budget (effort.py); without
    one nothing thinks, and it is logged as ignored."""

    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None  # accepted; no summary is written


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # padding against side channels: nothing to pad here


def _unsupported_off(name: str, value: Any) -> bool:
    """Whether `value` is the field's "off" value, which is accepted."""
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
    client_metadata: dict[str, Any] | None = None  # Codex's bookkeeping: unused
    # Extra output data (encrypted reasoning, logprobs, sources): none is filled here; logged once.
    include: list[str] | None = None
    # With --reasoning-parser (else a 400): the thinking's settings; ours, as on the chat route:
    # the most tokens the thinking may take before it is closed.
    reasoning: ReasoningConfig | None = None
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None
    # Ours, as on the chat route (vLLM's): a constraint by json, regex, choice or grammar (Lark or
    # GBNF), which text.format's JSON schemas cannot say.
    structured_outputs: dict[str, Any] | None = None
    # Refused unless "off" (see UNSUPPORTED_RESPONSE_FIELDS).
    background: bool | None = None
    conversation: Any = None
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

    _bounded = bounded_nesting(*_FREE_JSON_FIELDS)

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, items: Any) -> Any:
        if isinstance(items, list):
            known_kinds(items, _ITEM_TYPES, "items", "input[{i}]")
        return items

    _unavailable_tools: list[str] = PrivateAttr(default_factory=list)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        if isinstance(tools, list):
            known_kinds(tools, ("function", "namespace"), "tools", "tools[{i}]", also=UNAVAILABLE_TOOLS)
            return _flattened_tools(tools, []) or None
        return tools

    @model_validator(mode="wrap")
    @classmethod
    def _remember_unavailable_tools(cls, data: Any, handler: Any) -> Any:
        request = handler(data)  # the tools are checked (and flattened) by _function_tools_only
        tools = data.get("tools") if isinstance(data, dict) else None
        if isinstance(tools, list) and tools:
            _flattened_tools(tools, request._unavailable_tools)
        return request

    def ignored_fields(self, reasoning: bool) -> dict[str, str]:
        """The fields given that change nothing on this server (`reasoning`: it has a reasoning
        parser, so the effort is honoured): field -> why."""
        ignored = {}
        if self._unavailable_tools:
            ignored["tools"] = f"left out, the model cannot be given them here: {', '.join(self._unavailable_tools)}"
        if self.client_metadata:
            ignored["client_metadata"] = "client bookkeeping, unused"
        if self.include:
            ignored["include"] = f"no extra output data ({', '.join(self.include)}) is written here"
        if self.reasoning is not None and self.reasoning.summary not in (None, "none"):
            ignored["reasoning.summary"] = "no reasoning summary is written (the reasoning itself is returned)"
        if self.reasoning is not None and self.reasoning.effort is not None and not reasoning:
            ignored["reasoning.effort"] = "the model does not think (no --reasoning-parser)"
        if self.text is not None and self.text.verbosity is not None:
            ignored["text.verbosity"] = "the model is not told how verbose to be"
        if any(part.detail not in (None, "auto") for _, part in self.input_images()):
            ignored["input_image.detail"] = "the model's own image processor decides the resolution"
        if any(item.type == "reasoning" and item.encrypted_content for item in self.input):
            ignored["input.reasoning.encrypted_content"] = "nothing here can decrypt reasoning"
        return ignored

    def input_images(self) -> list[tuple[str, InputImage]]:
        """The input's images with their places (`input[i].content[j]`), in order."""
        return [(f"input[{i}].content[{j}]", part) for i, item in enumerate(self.input)
                if isinstance(item, MessageItem) and isinstance(item.content, list)
                for j, part in enumerate(item.content) if isinstance(part, InputImage)]

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
    namespace: str | None = None  # the namespace tool the function came from


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
