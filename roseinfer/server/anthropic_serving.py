"""Anthropic's Messages API as a front end over the chat route: a Messages request becomes the
chat completion request it means (system prompt, content blocks, tool_use / tool_result, tools and
tool_choice, sampling fields), which goes through the same engine path as /v1/chat/completions;
the output becomes a Message, or the typed events of a streamed one.

Thinking (a server started with --reasoning-parser): the parser splits the output into thinking
and answer; `message()` puts a thinking block before the answer's blocks, `message_stream()` feeds
the thinking to `ContentBlocks.thinking` (thinking_delta events) before the answer's pieces.
`thinking: {"type": "enabled", "budget_tokens": N}` is the chat request's thinking_token_budget,
`{"type": "adaptive"}` a budget from `output_config.effort` (effort.py), `{"type": "disabled"}` the
template's enable_thinking=false. Without a parser the model does not think: thinking settings are
accepted and logged as ignored (a gateway may ignore them; Claude Code sends them every turn).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ValidationError

from roseinfer.engine.input_processor import ChatPrompt
from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import CompletionOutput, RequestOutput
from roseinfer.reasoning import ReasoningDelta, ReasoningStream
from roseinfer.server.anthropic_protocol import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    ImageBlock,
    InputJsonDelta,
    InputMessage,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageResponse,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    OutputContent,
    PingEvent,
    StopReason,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseContent,
)
from roseinfer.server.effort import effort_fields
from roseinfer.server.error_responses import (
    GenerationError,
    error_event,
    generation_failure,
    status_of,
)
from roseinfer.server.image_parts import (
    chat_image_paths,
    image_places,
    in_request_terms,
    text_model_refusal,
)
from roseinfer.server.protocol import ChatCompletionRequest
from roseinfer.server.serving import OpenAIServing, Submitted
from roseinfer.tool_parsers import ContentDelta, ToolCall, ToolCallDelta

logger = logging.getLogger("roseinfer.server")

# The error `type` Anthropic's clients expect for each HTTP status this server answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=anthropic_error_type(status), message=message)).model_dump()


# -- requests --------------------------------------------------------------------------------

def _chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation in OpenAI's message shapes (what the chat template is given): the system
    prompt first; a user turn's tool_result blocks become `tool` messages, in order with its
    text; an assistant turn's tool_use blocks its `tool_calls`, its thinking `reasoning_content`;
    a system turn in the conversation stays where it is (the template places it)."""
    messages: list[dict[str, Any]] = []
    system = body.system_text()
    if system is not None:
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "system":
            messages.append({"role": "system", "content": [{"type": "text", "text": b.text} for b in message.content]})
        elif message.role == "user":
            messages.extend(_user_messages(message))
        else:
            messages.append(_assistant_message(message))
    if body.messages[-1].role == "assistant":
        raise InvalidRequestError(
            "messages: the last message is an assistant turn (a prefill for the response to continue), "
            "which this server does not support; end with a user turn", "messages")
    return messages


def _user_messages(message: InputMessage) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            if texts:
                result.append({"role": "user", "content": texts})
                texts = []
            # The template has no field for a failed call: the model reads it in the result itself.
            content = f"Error: {block.text()}" if block.is_error else block.text()
            result.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, ImageBlock):
            texts.append({"type": "image_url", "image_url": {"url": block.url()}})
        else:
            texts.append({"type": "text", "text": block.text})
    if texts or not result:
        result.append({"role": "user", "content": texts})
    return result


def _assistant_message(message: InputMessage) -> dict[str, Any]:
    texts = [{"type": "text", "text": b.text} for b in message.content if b.type == "text"]
    thinking = "".join(b.thinking for b in message.content if b.type == "thinking")
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if b.type == "tool_use"]
    result: dict[str, Any] = {"role": "assistant", "content": texts if texts or not calls else None}
    if calls:
        result["tool_calls"] = calls
    if thinking:
        result["reasoning_content"] = thinking
    return result


def _tool_choice(body: CountTokensRequest) -> tuple[Any, bool]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    choice = body.tool_choice
    if choice is None:
        if not body.tools:
            return None, True
        choice = ToolChoiceAuto(type="auto")  # Anthropic's default when tools are given
    if isinstance(choice, ToolChoiceNone):
        return "none", True
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}, False
    if isinstance(choice, ToolChoiceAny):
        return "required", not choice.disable_parallel_tool_use
    if choice.disable_parallel_tool_use:
        raise InvalidRequestError(
            'tool_choice: disable_parallel_tool_use is not supported with type "auto" (the model\'s own '
            'format is parsed, not constrained); with type "any" a grammar allows one call', "tool_choice")
    return "auto", True


def _thinking(body: CountTokensRequest, reasoning: bool) -> dict[str, Any]:
    """The chat request's fields for `thinking` and `output_config.effort` (`reasoning`: the
    server has a reasoning parser; without one both are ignored, and logged so by the route)."""
    if not reasoning:
        return {}
    if isinstance(body.thinking, ThinkingDisabled):
        # What a hybrid thinking template (Qwen3's) reads; a template without the switch ignores it.
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if isinstance(body.thinking, ThinkingEnabled):
        if not isinstance(body, MessagesRequest):
            return {}  # the budget does not change the prompt
        if body.thinking.budget_tokens >= body.max_tokens:
            raise InvalidRequestError(
                f"thinking.budget_tokens ({body.thinking.budget_tokens}) must be less than max_tokens "
                f"({body.max_tokens}), which counts the thinking too", "thinking.budget_tokens")
        return {"thinking_token_budget": body.thinking.budget_tokens}
    effort = body.output_config.effort if body.output_config is not None else None
    fields = effort_fields(effort)
    if not isinstance(body, MessagesRequest):
        fields.pop("thinking_token_budget", None)  # the budget does not change the prompt
    if effort is not None:  # a model whose prompt carries the effort (harmony's reasoning level)
        fields["reasoning_effort"] = effort
    return fields


def image_blocks(body: CountTokensRequest) -> list[str]:
    """Where the request's image blocks are (`messages[i].content[j]`), in order."""
    return [f"messages[{i}].content[{j}]" for i, message in enumerate(body.messages)
            if isinstance(message.content, list)
            for j, block in enumerate(message.content) if isinstance(block, ImageBlock)]


def chat_request(body: CountTokensRequest, reasoning: bool = False, takes_images: bool = True) -> ChatCompletionRequest:
    """The chat completion request that `body` means (a count_tokens request: its prompt only);
    `reasoning`: the server has a reasoning parser; `takes_images`: the model reads images (else
    an image block is refused, naming it)."""
    images = image_blocks(body)
    if images and not takes_images:
        raise text_model_refusal(images[0], "image block")
    fields: dict[str, Any] = {"model": body.model, "messages": _chat_messages(body), **_thinking(body, reasoning)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.input_schema, "strict": tool.strict,
        }} for tool in body.tools]
    if isinstance(body, MessagesRequest):
        fields["tool_choice"], fields["parallel_tool_calls"] = _tool_choice(body)
        if body.output_config is not None and body.output_config.format is not None:
            if fields["tool_choice"] not in (None, "none", "auto"):
                raise InvalidRequestError(
                    'output_config.format cannot be combined with tool_choice "any" or "tool", which '
                    "already constrain the output", "output_config")
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.schema_}}
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k, stop=body.stop_sequences, stream=body.stream,
                      structured_outputs=body.structured_outputs)
    elif body.tools:
        fields["tool_choice"] = "none"  # the prompt holds the tools whatever the choice
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # the Anthropic models check what this needs; a gap is still a 400
        raise InvalidRequestError(f"the request cannot be served: {exc.errors()[0]['msg']}") from exc


def in_anthropic_terms(exc: InvalidRequestError, body: CountTokensRequest | None = None,
                       chat: ChatCompletionRequest | None = None) -> InvalidRequestError:
    """An error the chat path raised, naming the Anthropic field where the two names differ (an
    image's place: `body` and the `chat` request it became)."""
    if exc.param == "stop":
        return InvalidRequestError(str(exc).replace("stop", "stop_sequences", 1), "stop_sequences")
    if body is not None and chat is not None:
        return in_request_terms(exc, image_places(chat_image_paths(chat.messages), image_blocks(body)))
    return exc


def prompt_of(chat: ChatCompletionRequest, serving: OpenAIServing) -> ChatPrompt:
    requests, _ = serving.chat_requests(chat)
    return requests[0].prompt


# -- responses -------------------------------------------------------------------------------

def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(completion: CompletionOutput, called_tools: bool) -> tuple[StopReason, str | None]:
    if completion.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _tool_use_blocks(calls: list[ToolCall]) -> tuple[list[OutputContent], str]:
    """tool_use blocks for the calls whose input is a JSON object, and the text of any other (a
    call cut short by max_tokens), which only a text block can carry."""
    blocks: list[OutputContent] = []
    leftover = ""
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            arguments = None
        if isinstance(arguments, dict):
            blocks.append(ToolUseContent(id=_tool_use_id(call.id), name=call.name, input=arguments))
        else:
            leftover += call.arguments
    return blocks, leftover


def _event(event: BaseModel) -> str:
    payload = event.model_dump()
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ContentBlocks:
    """Numbers the content blocks of a streamed message, opening and closing them as the pieces
    come: text goes to a text block, each tool call to a tool_use block of its own (its arguments
    as input_json_delta pieces). A ping follows the first block's start, as Anthropic sends it."""

    def __init__(self) -> None:
        self.index = -1
        self._open: tuple[str, int] | None = None  # (kind, tool-call index)
        self._pinged = False

    @property
    def opened_any(self) -> bool:
        return self.index >= 0

    def text(self, text: str, *, even_empty: bool = False) -> list[BaseModel]:
        if not text and not even_empty:
            return []
        events = self._start(("text", 0), TextContent(text=""))
        if text:
            events.append(ContentBlockDeltaEvent(index=self.index, delta=TextDelta(text=text)))
        return events

    def tool_call(self, piece: ToolCallDelta) -> list[BaseModel]:
        events: list[BaseModel] = []
        if piece.name is not None:
            block = ToolUseContent(id=_tool_use_id(piece.id or ""), name=piece.name, input={})
            events = self._start(("tool_use", piece.index), block)
        if piece.arguments:
            events.append(ContentBlockDeltaEvent(index=self.index, delta=InputJsonDelta(partial_json=piece.arguments)))
        return events

    def thinking(self, text: str) -> list[BaseModel]:
        if not text:
            return []
        events = self._start(("thinking", 0), ThinkingContent(thinking=""))
        events.append(ContentBlockDeltaEvent(index=self.index, delta=ThinkingDelta(thinking=text)))
        return events

    def close(self) -> list[BaseModel]:
        if self._open is None:
            return []
        self._open = None
        return [ContentBlockStopEvent(index=self.index)]

    def _start(self, key: tuple[str, int], block: OutputContent) -> list[BaseModel]:
        if self._open == key:
            return []
        events = self.close()
        self.index += 1
        self._open = key
        events.append(ContentBlockStartEvent(index=self.index, content_block=block))
        if not self._pinged:
            self._pinged = True
            events.append(PingEvent())
        return events


class AnthropicServing:
    """The Messages API over the chat route's serving (its submit and its output streams)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def message(self, body: MessagesRequest, submitted: Submitted) -> MessageResponse:
        (output,) = await self.serving.final_outputs(submitted)
        completion = output.outputs[0]
        text: str | None = completion.text
        calls: list[ToolCall] = []
        thinking: list[OutputContent] = []
        parser = self.serving.reasoning_parser
        if parser is not None:  # tool calls are read from the answer only
            split = parser.split(completion.text, output.prompt)
            text = split.content or ""
            thinking = [ThinkingContent(thinking=split.reasoning)] if split.reasoning else []
        if submitted.tool_calling is not None:
            text, calls = submitted.tool_calling.extract(text or "")
        tool_blocks, leftover = _tool_use_blocks(calls)
        text = (text or "") + leftover
        content: list[OutputContent] = [TextContent(text=text)] if text or not (tool_blocks or thinking) else []
        stop_reason, stop_sequence = _stop(completion, bool(tool_blocks))
        submitted.log()
        return MessageResponse(
            id=_message_id(submitted), model=self.serving.model_name, content=thinking + content + tool_blocks,
            stop_reason=stop_reason, stop_sequence=stop_sequence,
            usage=_usage(output, submitted, submitted.completion_tokens),
        )

    async def message_stream(self, body: MessagesRequest, submitted: Submitted) -> AsyncIterator[str]:
        blocks = ContentBlocks()
        tools = submitted.tool_calling.stream() if submitted.tool_calling is not None else None
        parser = self.serving.reasoning_parser
        reasoning: ReasoningStream | None = None
        last: CompletionOutput | None = None
        async for output in self.serving.outputs(submitted):
            completion = output.outputs[0]
            if completion.error is not None:
                raise generation_failure(completion)
            events: list[BaseModel] = []
            if last is None:
                events.append(MessageStartEvent(message=MessageResponse(
                    id=_message_id(submitted), model=self.serving.model_name, content=[],
                    usage=_usage(output, submitted, 0))))
                if parser is not None:
                    reasoning = parser.stream(output.prompt)
                elif tools is None:  # a plain answer: its text block opens at once, as Anthropic's does
                    events += blocks.text("", even_empty=True)
            last = completion
            answer = completion.text
            if reasoning is not None:  # the thinking first; tool calls are read from the answer only
                split = reasoning.feed(answer)
                if completion.finished:
                    tail = reasoning.finish()
                    split = ReasoningDelta(split.reasoning + tail.reasoning, split.content + tail.content)
                events += blocks.thinking(split.reasoning)
                answer = split.content
            if tools is None:
                events += blocks.text(answer)
            else:
                for piece in tools.feed(answer) + (tools.finish() if completion.finished else []):
                    events += blocks.text(piece.text) if isinstance(piece, ContentDelta) else blocks.tool_call(piece)
            for event in events:
                yield _event(event)
        if last is None:  # the stream ended without an output: only an error does that, and it raised
            return
        called_tools = tools is not None and tools.sent_tool_calls
        closing = [] if blocks.opened_any else blocks.text("", even_empty=True)
        stop_reason, stop_sequence = _stop(last, called_tools)
        for event in [*closing, *blocks.close(),
                      MessageDeltaEvent(delta=MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
                                        usage=MessageDeltaUsage(output_tokens=submitted.completion_tokens)),
                      MessageStopEvent()]:
            yield _event(event)
        submitted.log()


def _usage(output: RequestOutput, submitted: Submitted, output_tokens: int) -> MessageUsage:
    cached = sum(submitted.cached_tokens.values())
    return MessageUsage(input_tokens=len(output.prompt_token_ids) - cached, output_tokens=output_tokens,
                        cache_read_input_tokens=cached)


def _message_id(submitted: Submitted) -> str:
    return "msg_" + submitted.response_id.removeprefix("msg-")


async def guarded_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events; a failure once the response has started (the engine stopped, the time
    limit, a shutdown) ends it with Anthropic's error event, so the client hears why."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        status = status_of(exc)
        if status == 500 and not isinstance(exc, GenerationError):
            logger.exception("a stream failed")
        else:
            logger.info("a stream ended early: %s", exc)
        yield _event(AnthropicErrorResponse(error=AnthropicErrorInfo(
            type=anthropic_error_type(status), message=error_event(exc)["error"]["message"])))
