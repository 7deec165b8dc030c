"""OpenAI's own routes: GET /v1/models, POST /v1/completions and POST /v1/chat/completions
(whole or streamed), rendered by completions_serving and chat_serving."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from roseinfer.server.api_family import ApiContext, unless_disconnected
from roseinfer.server.chat_serving import ChatServing
from roseinfer.server.completions_serving import CompletionServing
from roseinfer.server.ignored_fields import log_ignored
from roseinfer.server.openapi import errors, finish_document, streamed
from roseinfer.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from roseinfer.server.serving import guarded_sse

STARTED = time.time()  # the model's "created" time: when this server came up


def register(app: FastAPI, context: ApiContext) -> None:
    engine, serving, check_model = context.engine, context.serving, context.check_model
    completion, chat = CompletionServing(serving), ChatServing(serving)
    router = APIRouter()
    generation_errors = errors(400, 401, 404, 408, 413, 500, 503)

    def card() -> ModelCard:
        created = datetime.fromtimestamp(STARTED, UTC).isoformat().replace("+00:00", "Z")
        default_cap = engine.input_processor.limits.default_max_tokens
        return ModelCard(id=context.model_name, root=engine.model_name, max_model_len=engine.max_model_len,
                         created=int(STARTED), display_name=context.model_name, created_at=created,
                         max_input_tokens=engine.max_model_len,
                         max_tokens=min(default_cap or engine.max_model_len, engine.max_model_len),
                         input_modalities=["text", "image"] if serving.takes_images else ["text"])

    @router.get("/v1/models", responses=errors(401))
    async def models() -> ModelList:
        return ModelList(data=[card()], first_id=context.model_name, last_id=context.model_name)

    @router.get("/v1/models/{model_id:path}", responses=errors(401, 404))
    async def model(model_id: str) -> ModelCard:
        """The served model (OpenAI's retrieve; Anthropic's, which Claude Code asks for its context
        and output limits); any other name is a 404."""
        context.check_model(model_id)
        return card()

    @router.post("/v1/completions", responses=streamed(CompletionResponse, CompletionResponse) | generation_errors)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        submitted = await serving.submit("/v1/completions", "cmpl", completion.requests(body), body.n)
        if body.stream:
            return StreamingResponse(guarded_sse(completion.stream(body, submitted)), media_type="text/event-stream")
        return await unless_disconnected(request, completion.response(body, submitted))

    @router.post("/v1/chat/completions", responses=streamed(ChatCompletionResponse, ChatCompletionChunk)
                 | generation_errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        log_ignored(request, body.ignored_fields(serving.reasoning_parser is not None))
        requests, tool_calling = serving.chat_requests(body)
        submitted = await serving.submit("/v1/chat/completions", "chatcmpl", requests, body.n, tool_calling)
        if body.stream:
            return StreamingResponse(guarded_sse(chat.stream(body, submitted)), media_type="text/event-stream")
        return await unless_disconnected(request, chat.response(body, submitted))

    app.include_router(router)
    finish_document(app, extra_models=[ChatCompletionChunk])  # what only the stream sends
