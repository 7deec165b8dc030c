"""Request and response bodies of the HTTP API: OpenAI's shapes, vLLM's extensions, the seed's
/generate. Range checks that OpenAI documents live here, so a bad field is named in a 400."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from roseinfer.sampling_params import MAX_LOGPROBS, MAX_N

TokenIds = list[Annotated[int, Field(ge=0)]]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share; unknown fields are ignored, as OpenAI's
    clients send some that only apply to other models."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN and Infinity are named as such

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
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

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


class ChatMessage(BaseModel):
    # tool_calls, name, ... reach the template. The schema says what `_needs_content` checks.
    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"],
         "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}},
    ]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

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

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateRequest(BaseModel):
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "roseinfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class GenerateResponse(BaseModel):
    text: str
    finish_reason: str | None = None
    prompt_tokens: int
    completion_tokens: int
