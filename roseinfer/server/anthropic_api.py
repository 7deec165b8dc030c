"""The routes of Anthropic's Messages API: POST /v1/messages (whole or streamed) and POST
/v1/messages/count_tokens, over the chat route's engine path (see anthropic_serving.py), with every
error on them in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.

The API key is the server's --api-key, sent as `x-api-key` (Anthropic's header) or as
`Authorization: Bearer` (see middleware.ApiKeyGuard).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from roseinfer.errors import InvalidRequestError
from roseinfer.server.anthropic_protocol import (
    STREAM_EVENTS,
    AnthropicErrorResponse,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from roseinfer.server.anthropic_serving import (
    AnthropicServing,
    anthropic_error_body,
    chat_request,
    guarded_events,
    in_anthropic_terms,
    prompt_of,
)
from roseinfer.server.api_family import ApiContext, unless_disconnected
from roseinfer.server.ignored_fields import log_ignored
from roseinfer.server.middleware import ErrorReshape, error_message_of
from roseinfer.server.openapi import _ERRORS, _RETRY_AFTER, finish_document

PATH_PREFIX = "/v1/messages"


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, in Anthropic's error shape."""
    return {status: {"model": AnthropicErrorResponse, "description": _ERRORS[status]}
            | ({"headers": _RETRY_AFTER} if status == 503 else {}) for status in statuses}


def _streamed_message() -> dict[int | str, dict[str, Any]]:
    """The 200 response: a Message, or with `stream: true` Anthropic's server-sent events (the
    event-stream schema describes one event)."""
    names = [event.model_fields["type"].default for event in STREAM_EVENTS]
    event = {
        "type": "object", "required": ["event", "data"],
        "properties": {
            "event": {"enum": names},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
                {"$ref": f"#/components/schemas/{model.__name__}"} for model in STREAM_EVENTS]}},
        },
    }
    description = ("The whole Message; with `stream: true`, server-sent events `event: <type>` / `data: <event>`: "
                   "message_start, then per content block content_block_start, content_block_delta..., "
                   "content_block_stop (a ping after the first start), then message_delta (stop_reason, "
                   "usage) and message_stop; an `error` event if the request fails after the stream started.")
    return {200: {"model": MessageResponse, "description": description,
                  "content": {"text/event-stream": {"schema": event}}}}


def _reshaped(status: int, body: bytes) -> bytes:
    """Anthropic's error object for the body of an error response."""
    return json.dumps(anthropic_error_body(status, error_message_of(status, body)), ensure_ascii=False).encode()


def register(app: FastAPI, context: ApiContext) -> None:
    """Add the Messages routes and their error shaping to the app (call it after the app's other
    middleware is added, so that the shaping wraps them all)."""
    serving, check_model = context.serving, context.check_model
    anthropic = AnthropicServing(serving)
    engine = serving.engine
    router = APIRouter(tags=["Anthropic Messages"])
    generation_errors = _errors(400, 401, 404, 408, 413, 500, 503)
    reasoning = serving.reasoning_parser is not None  # whether thinking can be enabled

    @router.post(PATH_PREFIX, responses=_streamed_message() | generation_errors)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API (its official clients work against this server)."""
        check_model(body.model)
        log_ignored(request, body.ignored_fields(reasoning))
        chat = chat_request(body, reasoning, serving.takes_images)
        try:
            requests, tool_calling = serving.chat_requests(chat)
            for engine_request in requests:  # max_tokens is an upper bound: cut to what fits
                engine_request.fit_max_tokens = True
            submitted = await serving.submit(PATH_PREFIX, "msg", requests, 1, tool_calling)
        except InvalidRequestError as exc:
            raise in_anthropic_terms(exc, body, chat) from exc
        if body.stream:
            return StreamingResponse(guarded_events(anthropic.message_stream(body, submitted)),
                                     media_type="text/event-stream")
        return await unless_disconnected(request, anthropic.message(body, submitted))

    @router.post(PATH_PREFIX + "/count_tokens", responses=_errors(400, 401, 404, 413))
    async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
        """The prompt tokens a Messages request with these messages, system prompt and tools
        would feed the model (its chat template applied)."""
        check_model(body.model)
        log_ignored(request, body.ignored_fields(reasoning))
        chat = chat_request(body, reasoning, serving.takes_images)
        try:
            prompt = prompt_of(chat, serving)
            _, ids = await asyncio.get_running_loop().run_in_executor(None, engine.input_processor.tokenize, prompt)
        except InvalidRequestError as exc:
            raise in_anthropic_terms(exc, body, chat) from exc
        return TokenCount(input_tokens=len(ids))

    app.include_router(router)
    finish_document(app, extra_models=STREAM_EVENTS)  # what only the stream sends
    app.add_middleware(ErrorReshape, prefix=PATH_PREFIX, reshape=_reshaped)
