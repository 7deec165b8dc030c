"""Request and response bodies of the HTTP API: OpenAI's shapes, vLLM's extensions, the seed's
/generate. Range checks that OpenAI documents live here, so a bad field is named in a 400.

Request bodies forbid fields they do not declare: a field that would change the output and is not
implemented (`UNSUPPORTED_FIELDS`), or one that neither OpenAI nor vLLM defines, is a 400 that
names it. Fields that change nothing here (`user`, `metadata`, `store`, ...) are declared and
accepted."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from roseinfer.sampling_params import MAX_LOGPROBS, MAX_N

TokenIds = list[Annotated[int, Field(ge=0)]]
# How deeply a request field may nest lists and objects: far more than real schemas, messages and
# tools need, and less than where the code that reads them fails (llguidance's JSON parser at 128
# levels with its own wrapping, the recursive walks of tool schemas at about 450, Python's JSON
# parser at about 1000). So any deeper value is one 400 naming its field.
MAX_NESTING_DEPTH = 100
# The fields whose values may be any JSON (schemas, tools, messages' extra keys, template
# variables); the others' types bound how deep they nest.
_FREE_JSON_FIELDS = ("messages", "tools", "response_format", "structured_outputs", "chat_template_kwargs",
                     "metadata", "prediction")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# Request fields that OpenAI or vLLM define, that would change the output, and that this server
# does not implement: field -> what to do instead.
UNSUPPORTED_FIELDS = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported; leave modalities out",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "verbosity": "not supported; leave verbosity out",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (fill-in-the-middle) is not supported",
    "best_of": "best_of is not supported; use n",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported; use logit_bias or structured_outputs",
    "bad_words": "bad_words is not supported; use logit_bias",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "add_special_tokens": "add_special_tokens is not supported",
    "documents": "documents are not supported",
    "chat_template": "a per-request chat template is not supported; the model's own is used",
    "mm_processor_kwargs": "per-request processor options are not supported; the model's own processor config is used",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not supported",
    "logits_processors": "custom logits processors are not supported",
    "guided_json": "use structured_outputs: {\"json\": ...} (vLLM's current spelling)",
    "guided_regex": "use structured_outputs: {\"regex\": ...}",
    "guided_choice": "use structured_outputs: {\"choice\": [...]}",
    "guided_grammar": "use structured_outputs: {\"grammar\": ...}",
    "guided_decoding_backend": "the structured-output backend is llguidance; leave this out",
    "structural_tag": "structural tags are not supported",
}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's; usage in every chunk is not implemented


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('type "json_schema" needs json_schema.schema')
        return self


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


# What the load balancers in front of replicas (vllm-router, sglang-router) write into every
# request they forward: their request types' defaults, which change nothing. Accepted with exactly
# these values and dropped; any other value is still an unknown or unsupported field.
ROUTER_DEFAULTS = {"no_stop_trim": False, "return_hidden_states": False, "continue_final_message": False,
                   "separate_reasoning": True, "stream_reasoning": True}


def nesting_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests lists and objects more than `limit` levels deep. Level by level, not
    recursively: a value too deep for recursion is what this is for."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        level = [child for container in level
                 for child in (container.values() if isinstance(container, dict) else container)
                 if isinstance(child, dict | list)]
        if not level:
            return False
    return bool(level)


def _not_nested_too_deep(value: Any) -> Any:
    if nesting_depth_exceeds(value, MAX_NESTING_DEPTH):
        raise ValueError(f"nested more than {MAX_NESTING_DEPTH} levels deep (this server's limit)")
    return value


def bounded_nesting(*fields: str) -> Any:
    """A request model's validator that bounds how deeply these free-JSON fields nest (assign it
    to a class attribute: `_bounded = bounded_nesting("messages", "tools")`)."""
    return field_validator(*fields, mode="before", check_fields=False)(_not_nested_too_deep)


def known_kinds(items: Sequence[Any], allowed: Sequence[str], what: str, where: str,
                media: Sequence[str] = (), why: str = "", also: Sequence[str] = ()) -> None:
    """Check the `type` of each object in a list of parts, items or blocks against the kinds a
    field takes (`allowed`, and `also`, which the caller handles otherwise): an unknown kind is a
    ValueError naming it and where it is (`where` formats the index as {i}); a media kind (an
    image, a document) says it is the model that cannot take it."""
    for i, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if not isinstance(kind, str) or kind in allowed or kind in also:
            continue
        if kind in media:
            raise ValueError(f"{where.format(i=i)}: {kind!r} {what} cannot be given to this model: {why}")
        raise ValueError(f"{where.format(i=i)}: {what} of type {kind!r} are not supported by this server "
                         f"(it takes {', '.join(allowed)})")


def kinds_checked(field: str, allowed: Sequence[str], what: str, where: str, media: Sequence[str] = (),
                  why: str = "", then: Callable[[Any], Any] | None = None) -> Any:
    """A request model's before-validator of a field that takes a string or a list of typed parts:
    the list's kinds checked by `known_kinds`, then the value handed to `then` (if given) (assign
    it to a class attribute, as `bounded_nesting`)."""

    def check(value: Any) -> Any:
        if isinstance(value, list):
            known_kinds(value, allowed, what, where, media=media, why=why)
        return value if then is None else then(value)

    return field_validator(field, mode="before")(check)


class SamplingFields(StrictModel):
    """What completions and chat completions share."""

    _bounded = bounded_nesting(*_FREE_JSON_FIELDS)

    @model_validator(mode="before")
    @classmethod
    def _drop_router_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(name in data for name in ROUTER_DEFAULTS):
            data = {name: value for name, value in data.items()
                    if not (name in ROUTER_DEFAULTS and value is ROUTER_DEFAULTS[name])}
        return data

    model_config = ConfigDict(allow_inf_nan=False)  # NaN and Infinity are named as such

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's fields that change nothing here: accepted.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extensions
    structured_outputs: dict[str, Any] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # prefix-cache blocks are shared only within one salt (checked by the engine)
    # With --reasoning-parser: the most tokens the thinking may take before it is closed.
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _non_empty_prompts(schema: dict[str, Any]) -> None:
    """Say in the schema what `_prompt_not_empty` checks: no empty string, list or token list."""
    for member in schema.get("anyOf", []):
        if member.get("type") == "string":
            member["minLength"] = 1
        elif member.get("type") == "array":
            member["minItems"] = 1
            items = member.get("items", {})
            items.update({"minLength": 1} if items.get("type") == "string" else {})
            items.update({"minItems": 1} if items.get("type") == "array" else {})


class CompletionRequest(SamplingFields):
    prompt: Annotated[str | list[str] | TokenIds | list[TokenIds], Field(json_schema_extra=_non_empty_prompts)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: str | list) -> str | list:
        if not prompt or (isinstance(prompt, list) and any(not p for p in prompt if not isinstance(p, int))):
            raise ValueError("a prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: Annotated[str, Field(min_length=1)]  # a data URL, or http(s) from --allowed-media-domains
    # OpenAI's resolution hint: the model's own processor decides the resolution here, so any value
    # other than "auto" is logged as ignored (ChatCompletionRequest.ignored_fields).
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(StrictModel):
    """An image in a message (a vision-language model; a text model refuses it, naming the part)."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]
_CONTENT_PARTS = TypeAdapter(list[ContentPart])


def content_parts(content: Any) -> Any:
    """A message's list of parts validated on its own, so that a bad part is named in the error
    (where `str | list` would report the string's mismatch first)."""
    if not isinstance(content, list):
        return content
    try:
        return _CONTENT_PARTS.validate_python(content)
    except ValidationError as exc:
        error = exc.errors()[0]
        location = [str(part) for part in error["loc"]]
        if len(location) > 1 and location[1] in ("text", "image_url"):  # the union's tag, not a field
            del location[1]
        where = f"content[{location[0]}]" + "".join(f".{part}" for part in location[1:]) if location else "content"
        raise ValueError(f"{where}: {error['msg'].removeprefix('Value error, ')}") from None


class ChatMessage(BaseModel):
    # tool_calls, tool_call_id, name, ... reach the template. The schema says what `_needs_content` checks.
    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"],
         "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}},
    ]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    _parts = field_validator("content", mode="before")(content_parts)

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and getattr(self, "tool_calls", None)):
            raise ValueError("an assistant message needs content or tool_calls" if self.role == "assistant"
                             else f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Ours: special-token strings in messages, tools and chat_template_kwargs become special
    # tokens, not text (see ChatPrompt for why this is a request's choice).
    parse_special_tokens_in_messages: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    prediction: dict[str, Any] | None = None  # OpenAI's predicted output: a speed hint, same output
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out of the response
    # How hard a thinking model thinks: a thinking budget with --reasoning-parser (effort.py); else
    # nothing thinks, and it is logged as ignored.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def ignored_fields(self, reasoning: bool) -> dict[str, str]:
        """The fields given that change nothing here (`reasoning`: a reasoning parser honours them)."""
        ignored = {}
        if self.reasoning_effort is not None and not reasoning:
            ignored["reasoning_effort"] = "the model does not think (no --reasoning-parser)"
        if any(isinstance(part, ImageURLPart) and part.image_url.detail not in (None, "auto")
               for message in self.messages if isinstance(message.content, list) for part in message.content):
            ignored["image_url.detail"] = "the model's own image processor decides the resolution"
        return ignored

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateRequest(StrictModel):
    """The seed's native endpoint."""

    model_config = ConfigDict(allow_inf_nan=False)

    prompt: Annotated[str, Field(min_length=1)]
    max_new_tokens: Annotated[int, Field(ge=1)] = 64
    temperature: Annotated[float, Field(ge=0.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop_on_eos: bool = True
    do_sample: bool = False
    stream: bool = False
    seed: int | None = None


# -- responses -------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallModel(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A thinking model's thinking (--reasoning-parser): vLLM's field, and `reasoning`, its newer name.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallModel] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # a piece of the thinking, under both of vLLM's names
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's tool-call deltas (index, id, function)


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """A model in OpenAI's shape, with Anthropic's Model fields beside (their official clients,
    and Claude Code's model probe, read these): one object serves both."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "roseinfer"
    root: str | None = None
    max_model_len: int | None = None
    type: Literal["model"] = "model"
    display_name: str | None = None
    created_at: str | None = None  # RFC 3339
    max_input_tokens: int | None = None  # the context (Anthropic's name)
    max_tokens: int | None = None  # the most a response generates: the default cap
    # What the model reads: ["text"], or ["text", "image"] for a vision-language model (OpenRouter's
    # name for it; the chat page offers to attach images only when "image" is listed).
    input_modalities: list[Literal["text", "image"]] = Field(default_factory=lambda: ["text"])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    # Anthropic's page fields (there is one page).
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class GenerateResponse(BaseModel):
    text: str
    finish_reason: str | None = None
    prompt_tokens: int
    completion_tokens: int
