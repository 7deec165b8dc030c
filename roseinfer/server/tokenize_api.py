"""POST /tokenize and POST /detokenize, in vLLM's shapes: text or chat messages to the token ids the
engine would feed (the chat route's prompt, from the same input processor), and ids back to text.
Errors are OpenAI's error object, as vLLM answers these routes with."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from roseinfer.errors import InvalidRequestError
from roseinfer.server.api_family import ApiContext
from roseinfer.server.openapi import errors
from roseinfer.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    StrictModel,
    TokenIds,
    ToolDefinition,
    bounded_nesting,
)

_CHAT_ONLY = ("add_generation_prompt", "chat_template_kwargs", "tools", "parse_special_tokens_in_messages",
              "reasoning_effort")


class TokenizeRequest(StrictModel):
    """vLLM's two tokenize requests in one: `prompt` (text) or `messages` (a chat, rendered with the
    model's chat template as /v1/chat/completions renders it)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # vLLM's defaults: True for text, False for a chat (whose template writes its own special tokens).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    parse_special_tokens_in_messages: bool = False  # ours, as on the chat route
    # As on the chat route: a model whose prompt carries it (gpt-oss's harmony) renders it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    _bounded = bounded_nesting("messages", "tools", "chat_template_kwargs")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (text) or messages (a chat), not both or neither")
        if self.prompt is not None:
            given = [name for name in _CHAT_ONLY if name in self.model_fields_set]
            if given:
                raise ValueError(f"{', '.join(given)}: only for messages, not for a text prompt")
        elif self.add_special_tokens:
            raise ValueError("add_special_tokens: with messages the chat template writes the special tokens; "
                             "only false is supported (the ids the chat route feeds)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


def register(app: FastAPI, context: ApiContext) -> None:
    serving, check_model = context.serving, context.check_model
    engine = serving.engine
    tokenizer = engine.tokenizer
    router = APIRouter(tags=["Tokenizer"])

    def tokenize_prompt(body: TokenizeRequest) -> tuple[str | None, list[int]]:
        if body.prompt is not None:
            return engine.input_processor.tokenize(body.prompt, body.add_special_tokens is not False)
        chat = ChatCompletionRequest(
            messages=body.messages, add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs, tools=body.tools,
            tool_choice="none" if body.tools else None,  # the prompt holds the tools whatever the choice
            parse_special_tokens_in_messages=body.parse_special_tokens_in_messages,
            reasoning_effort=body.reasoning_effort,
        )
        requests, _ = serving.chat_requests(chat)
        return engine.input_processor.tokenize(requests[0].prompt)

    @router.post("/tokenize", responses=errors(400, 401, 404, 413))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """The token ids of a text prompt, or of chat messages as the chat route feeds them (the
        count may exceed max_model_len: compare the two)."""
        check_model(body.model)
        _, ids = await asyncio.get_running_loop().run_in_executor(None, tokenize_prompt, body)
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize", responses=errors(400, 401, 404, 413))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids (special tokens included)."""
        check_model(body.model)
        size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
        bad = [t for t in body.tokens if t >= size]
        if bad:
            raise InvalidRequestError(f"tokens contains {bad[:3]}, outside the tokenizer's vocabulary [0, {size})",
                                      "tokens")
        text = await asyncio.get_running_loop().run_in_executor(
            None, lambda: tokenizer.decode(body.tokens, skip_special_tokens=False))
        return DetokenizeResponse(prompt=text)

    app.include_router(router)
