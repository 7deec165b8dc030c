"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A front end over the same engine path as /v1/chat/completions: the request's input items (and,
with `previous_response_id`, the stored conversation before them) become chat messages, its
tools, tool_choice and text.format the chat route's tool calling and structured outputs, and the
engine's outputs become output items (responses_output.py), whole or as typed stream events.
Every limit of the chat route applies: the API key and body size (middleware), the prompt and
queue limits and the time limit (the engine's input processor and AsyncLLM).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from roseinfer.engine.async_llm import NewRequest
from roseinfer.engine.input_processor import ChatPrompt
from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import CompletionOutput
from roseinfer.reasoning import ReasoningDelta, ReasoningStream
from roseinfer.reasoning.base import Phase
from roseinfer.server.api_family import ApiContext, ApiError, unless_disconnected
from roseinfer.server.effort import effort_fields
from roseinfer.server.error_responses import (
    GenerationError,
    error_type,
    generation_failure,
    status_of,
)
from roseinfer.server.ignored_fields import log_ignored
from roseinfer.server.image_parts import (
    chat_image_paths,
    image_places,
    in_request_terms,
    text_model_refusal,
)
from roseinfer.server.openapi import errors
from roseinfer.server.protocol import (
    ChatCompletionRequest,
    ErrorResponse,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolDefinition,
    new_id,
)
from roseinfer.server.response_store import ResponseStore
from roseinfer.server.responses_output import Event, OutputBuilder
from roseinfer.server.responses_protocol import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from roseinfer.server.serving import OpenAIServing, Submitted, sampling_params
from roseinfer.server.tool_calling import tool_calling_for
from roseinfer.structured_output import StructuredOutputsParams
from roseinfer.tool_parsers import ToolCallStream

logger = logging.getLogger("roseinfer.server")

ROUTE = "/v1/responses"
_ITEMS = TypeAdapter(list[InputItem])


def _response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


# -- input items -> chat messages -------------------------------------------------------------

def chat_messages(items: list[Any], history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The chat messages `items` add to `history` (OpenAI's chat shapes, as the chat route's
    messages): a function_call joins the assistant message before it as a tool call, a
    function_call_output is a "tool" message, and a reasoning item becomes the next assistant
    message's `reasoning_content`."""
    messages = [dict(message) for message in history or []]  # the stored history is never changed
    known_calls = {call["id"] for m in messages for call in m.get("tool_calls", [])}
    reasoning: str | None = None
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text()
        elif isinstance(item, MessageItem):
            content: Any = item.content if isinstance(item.content, str) else [
                _image_url_part(part) if isinstance(part, InputImage) else
                {"type": "text", "text": getattr(part, "text", None) or getattr(part, "refusal", "")}
                for part in item.content]
            message = {"role": item.role, "content": content}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            known_calls.add(item.call_id)
            if messages and messages[-1]["role"] == "assistant" and reasoning is None:
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", []), call]
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in known_calls:
                raise InvalidRequestError(
                    f"input[{i}]: no function_call with call_id {item.call_id!r} comes before this "
                    "function_call_output (in input, or in the conversation of previous_response_id)",
                    f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _image_url_part(part: InputImage) -> dict[str, Any]:
    """An input_image as the chat route's image_url part (its detail logged as ignored, not sent)."""
    return {"type": "image_url", "image_url": {"url": part.image_url}}


def text_constraint(body: ResponsesRequest) -> StructuredOutputsParams | None:
    """The structured-outputs constraint `text.format` asks for (None: plain text)."""
    fmt = body.text.format if body.text is not None else None
    if body.structured_outputs is not None:
        if fmt is not None and fmt.type != "text":
            raise InvalidRequestError("give text.format or structured_outputs, not both", "structured_outputs")
        return StructuredOutputsParams.from_dict(body.structured_outputs)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        constraint = StructuredOutputsParams(json_object=True)
        constraint.param = "text.format"
    else:
        constraint = StructuredOutputsParams(json=fmt.schema_)
        constraint.param = "text.format.schema"  # where a schema llguidance rejects is named
    return constraint


def _thinking(body: ResponsesRequest, reasoning: bool) -> dict[str, Any]:
    """The chat request's fields for `reasoning.effort` (`reasoning`: the server has a reasoning
    parser; without one the effort is ignored, and logged so by the route)."""
    if body.reasoning is None or not reasoning:
        return {}
    # The effort itself for a model whose prompt carries it (harmony's reasoning level), and what
    # it means to a chat template's thinking model.
    fields = {"reasoning_effort": body.reasoning.effort, **effort_fields(body.reasoning.effort)}
    if body.thinking_token_budget is not None:  # the request's own bound wins over the effort's
        fields["thinking_token_budget"] = body.thinking_token_budget
    return fields


def _chat_body(body: ResponsesRequest, messages: list[dict[str, Any]], reasoning: bool) -> ChatCompletionRequest:
    """The chat request whose tool calling and sampling this response shares."""
    tools = [ToolDefinition(function=FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict))
        for tool in body.tools] if body.tools else None
    choice = body.tool_choice
    if tools is None and choice in ("auto", "none"):  # every tool given was one left out (a hosted tool)
        choice = None
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(function=NamedFunction(name=choice.name))
    try:
        return ChatCompletionRequest(
            messages=messages, tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
            max_completion_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            stream=body.stream, **({"thinking_token_budget": body.thinking_token_budget} | _thinking(body, reasoning)),
        )
    except ValidationError as exc:  # the input items made a message the chat shapes refuse
        raise InvalidRequestError(f"input: {exc.errors()[0]['msg']}", "input") from exc


# -- the serving ----------------------------------------------------------------------------

class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    def prepare(self, body: ResponsesRequest) -> tuple[list[dict[str, Any]], NewRequest, Any]:
        """(the conversation without instructions, the engine request, its tool calling)."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise ApiError(404, f"Previous response with id {body.previous_response_id!r} not found: it was "
                               "never stored (store: false), was deleted, or expired from this server's store "
                               "(see --responses-store-ttl).", "previous_response_id", "previous_response_not_found")
            history = stored.messages
        images = body.input_images()
        if images and not self.serving.takes_images:
            raise text_model_refusal(images[0][0], "input_image part")
        conversation = chat_messages(body.input, history)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        chat = _chat_body(body, messages, self.serving.reasoning_parser is not None)
        tool_calling = tool_calling_for(chat, self.serving.tool_call_parser)
        constraint = text_constraint(body)
        if tool_calling is not None and tool_calling.structured_outputs is not None:
            if constraint is not None:
                raise InvalidRequestError('tool_choice "required" or a named function already constrains the '
                                          "output; leave text.format out (or of type text)", "text.format")
            constraint = tool_calling.structured_outputs
        chat, effort = self.serving.with_effort(chat)
        prompt = ChatPrompt(messages, tools=[tool.model_dump(exclude_none=True) for tool in chat.tools]
                            if chat.tools else None, chat_template_kwargs=chat.chat_template_kwargs or None,
                            reasoning_effort=effort)
        params = sampling_params(chat, body.max_output_tokens, None, constraint)
        self.serving.keep_special_tokens(params, tool_calling)
        # max_output_tokens is an upper bound: cut to what fits after the prompt.
        return conversation, NewRequest(new_id("resp"), prompt, params, fit_max_tokens=True), tool_calling

    async def submit(self, body: ResponsesRequest) -> tuple[Submitted, list[dict[str, Any]]]:
        conversation, request, tool_calling = self.prepare(body)
        try:
            submitted = await self.serving.submit(ROUTE, "resp", [request], 1, tool_calling)
        except InvalidRequestError as exc:  # a bad image: named by its place in the input
            places = image_places(chat_image_paths(request.prompt.messages), [p for p, _ in body.input_images()])
            raise in_request_terms(exc, places) from exc
        submitted.response_id = _response_id()
        return submitted, conversation

    def _response(self, body: ResponsesRequest, submitted: Submitted, status: str,
                  output: list[dict[str, Any]], error: dict[str, str] | None = None) -> dict[str, Any]:
        usage = None
        if status != "in_progress":
            counted = submitted.usage()
            usage = {"input_tokens": counted.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": counted.prompt_tokens_details.cached_tokens},
                     "output_tokens": counted.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": counted.total_tokens}
        response = ResponseObject(
            id=submitted.response_id, status=status, model=self.serving.model_name, output=output,
            error=error, incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls, previous_response_id=body.previous_response_id,
            temperature=body.temperature, top_p=body.top_p,
            tool_choice=body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            tools=body.tools or [], text=body.text or {"format": {"type": "text"}},
            store=body.store and self.store.enabled, metadata=body.metadata or {}, user=body.user, usage=usage,
        )
        return response.model_dump(mode="json", by_alias=True)

    def _finish(self, body: ResponsesRequest, submitted: Submitted, conversation: list[dict[str, Any]],
                status: str, builder: OutputBuilder) -> dict[str, Any]:
        response = self._response(body, submitted, status, builder.items)
        if body.store:
            # The output items, read back as input items, continue the conversation.
            history = chat_messages(_ITEMS.validate_python(builder.items), conversation)
            self.store.put(response["id"], response, history)
        submitted.log()
        return response

    def _reasoning(self, prompt: str | None) -> ReasoningStream | None:
        parser = self.serving.reasoning_parser
        return parser.stream(prompt) if parser is not None else None

    async def create(self, body: ResponsesRequest, submitted: Submitted,
                     conversation: list[dict[str, Any]]) -> dict[str, Any]:
        (output,) = await self.serving.final_outputs(submitted)
        completion = output.outputs[0]
        builder = OutputBuilder(_namespaces(body))
        tools = submitted.tool_calling.stream() if submitted.tool_calling is not None else None
        _feed(builder, tools, self._reasoning(output.prompt), completion, finished=True)
        status = _status(completion)
        builder.close(status)
        return self._finish(body, submitted, conversation, status, builder)

    async def stream(self, body: ResponsesRequest, submitted: Submitted,
                     conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        sequence = 0

        def sse(event: Event) -> str:
            nonlocal sequence
            event = {**event, "sequence_number": sequence}
            sequence += 1
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        builder = OutputBuilder(_namespaces(body))
        try:
            started = self._response(body, submitted, "in_progress", [])
            yield sse({"type": "response.created", "response": started})
            yield sse({"type": "response.in_progress", "response": started})
            tools = submitted.tool_calling.stream() if submitted.tool_calling is not None else None
            status = "completed"
            reasoning: ReasoningStream | None = None
            async for output in self.serving.outputs(submitted):
                for completion in output.outputs:
                    if completion.error is not None:
                        raise generation_failure(completion)
                    if reasoning is None:
                        reasoning = self._reasoning(output.prompt)
                    for event in _feed(builder, tools, reasoning, completion, finished=completion.finished):
                        yield sse(event)
                    if completion.finished:
                        status = _status(completion)
            for event in builder.close(status):
                yield sse(event)
            response = self._finish(body, submitted, conversation, status, builder)
            yield sse({"type": f"response.{status}", "response": response})
        except Exception as exc:
            # The response has started: it ends with response.failed, whose error says why.
            if status_of(exc) == 500 and not isinstance(exc, GenerationError):
                logger.exception("%s %s: the stream failed", ROUTE, submitted.response_id)
            else:
                logger.info("%s %s: the stream ended early: %s", ROUTE, submitted.response_id, exc)
            error = {"code": error_type(status_of(exc)), "message": str(exc)}
            yield sse({"type": "response.failed",
                       "response": self._response(body, submitted, "failed", builder.items, error)})


def _namespaces(body: ResponsesRequest) -> dict[str, str]:
    """Function name -> the namespace tool it was flattened out of (its calls name it)."""
    return {tool.name: tool.namespace for tool in body.tools or [] if tool.namespace is not None}


def _status(completion: CompletionOutput) -> str:
    return "incomplete" if completion.finish_reason == "length" else "completed"


def _feed(builder: OutputBuilder, tools: ToolCallStream | None, reasoning: ReasoningStream | None,
          completion: CompletionOutput, finished: bool) -> list[Event]:
    """The events of what `completion` adds: with a reasoning parser the thinking first (the
    reasoning item), then the answer, from which alone tool calls are read."""
    events: list[Event] = []
    text = completion.text
    if reasoning is not None:
        split = reasoning.feed(text)
        if finished:
            tail = reasoning.finish()
            split = ReasoningDelta(split.reasoning + tail.reasoning, split.content + tail.content)
        if split.reasoning:
            events += builder.reasoning(split.reasoning)
        text = split.content
        if not text and reasoning.phase != Phase.ANSWERING:
            return events  # no answer yet: its message item opens once the thinking has ended
    if tools is None:
        return events + builder.text(text)  # the message item opens with the answer, as OpenAI's does
    pieces = tools.feed(text) + (tools.finish() if finished else [])
    return events + [event for piece in pieces for event in builder.delta(piece)]


# -- the routes -----------------------------------------------------------------------------

_EVENT_SCHEMA = {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {
        "type": "string", "contentMediaType": "application/json",
        "contentSchema": ResponseStreamEvent.model_json_schema()}},
}
_STREAMED = {200: {
    "model": ResponseObject,
    "description": "The response; with `stream: true`, server-sent events `event: <type>` / `data: <event>` in "
                   "the Responses API's order (response.created ... response.completed, or "
                   "response.incomplete when max_output_tokens cut it, or response.failed).",
    "content": {"text/event-stream": {"schema": _EVENT_SCHEMA}},
}}


def _not_found(what: str) -> dict[int | str, dict[str, Any]]:
    return {404: {"model": ErrorResponse, "description": what}}


def register(app: FastAPI, context: ApiContext) -> None:
    """Add the Responses API's routes to `app` (whose handlers turn errors into OpenAI's shape)."""
    store, check_model = context.response_store, context.check_model
    responses = ResponsesServing(context.serving, store)
    router = APIRouter()

    def stored(response_id: str) -> dict[str, Any]:
        entry = store.get(response_id)
        if entry is None:
            raise ApiError(404, f"Response with id {response_id!r} not found: it was never stored (store: false), "
                           f"was deleted, or expired (this server keeps responses {store.ttl:g} s, at most "
                           f"{store.max_entries}).", "response_id", "not_found")
        return entry.response

    @router.post(ROUTE, responses=_STREAMED | errors(400, 401, 408, 413, 500, 503) | _not_found(
        "The model named is not served here, or previous_response_id is not in the store."))
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        check_model(body.model)
        log_ignored(request, body.ignored_fields(context.serving.reasoning_parser is not None))
        submitted, conversation = await responses.submit(body)
        if body.stream:
            return StreamingResponse(responses.stream(body, submitted, conversation), media_type="text/event-stream")
        return await unless_disconnected(request, responses.create(body, submitted, conversation))

    @router.get(ROUTE + "/{response_id}", responses=errors(401) | _not_found("No stored response has this id."))
    async def get_response(response_id: str) -> ResponseObject:
        return JSONResponse(stored(response_id))

    @router.delete(ROUTE + "/{response_id}", responses=errors(401) | _not_found("No stored response has this id."))
    async def delete_response(response_id: str) -> DeletedResponse:
        stored(response_id)
        store.delete(response_id)
        return DeletedResponse(id=response_id)

    app.include_router(router)
