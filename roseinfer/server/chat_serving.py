"""/v1/chat/completions: the outputs of a chat body's engine request (built by
`OpenAIServing.chat_requests`, which /tokenize and the Messages API share) to OpenAI's
ChatCompletionResponse, whole or as a stream of chunks, with the thinking split off and tool calls
parsed out of the answer."""

from __future__ import annotations

from collections.abc import AsyncIterator

from roseinfer.outputs import TokenLogprob
from roseinfer.reasoning import ReasoningDelta, ReasoningStream
from roseinfer.server.error_responses import error_event, generation_failure
from roseinfer.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaMessage,
    TokenLogprobEntry,
    TopLogprob,
)
from roseinfer.server.serving import OpenAIServing, Submitted, sse
from roseinfer.tool_parsers import Delta, ToolCallDelta


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in entries:
            text = self.serving.token_text(entry.token_id)
            top = [TopLogprob(token=(t := self.serving.token_text(i)), logprob=lp, bytes=list(t.encode()))
                   for i, lp in entry.top]
            content.append(TokenLogprobEntry(token=text, logprob=entry.logprob, bytes=list(text.encode()),
                                             top_logprobs=top))
        return ChatLogprobs(content=content)

    async def response(self, body: ChatCompletionRequest, submitted: Submitted) -> ChatCompletionResponse:
        (output,) = await self.serving.final_outputs(submitted)
        choices = []
        for c in output.outputs:
            answer, reasoning = c.text, None
            if self.serving.reasoning_parser is not None:  # tool calls are read from the answer only
                split = self.serving.reasoning_parser.split(c.text, output.prompt)
                answer, reasoning = split.content, split.reasoning if body.include_reasoning else None
            message = AssistantMessage(content=answer, reasoning_content=reasoning, reasoning=reasoning)
            finish_reason = c.finish_reason
            if submitted.tool_calling is not None and answer is not None:
                content, calls = submitted.tool_calling.extract(answer)
                if calls:
                    message = AssistantMessage(content=content, reasoning_content=reasoning, reasoning=reasoning,
                                               tool_calls=[call.to_openai() for call in calls])
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            choices.append(ChatChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(c.logprobs) if body.logprobs and c.logprobs is not None else None,
                finish_reason=finish_reason, stop_reason=c.stop_reason,
            ))
        submitted.log()
        return ChatCompletionResponse(id=submitted.response_id, model=self.serving.model_name, choices=choices,
                                      usage=submitted.usage())

    async def stream(self, body: ChatCompletionRequest, submitted: Submitted) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice]) -> str:
            payload = ChatCompletionChunk(id=submitted.response_id, model=self.serving.model_name,
                                          choices=choices).model_dump(exclude={"usage"})
            for choice in payload["choices"]:  # a delta carries only what changed, as OpenAI's do
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return sse(payload)

        # The role comes first, once per choice, as OpenAI sends it.
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(body.n)])
        tool_streams = {i: submitted.tool_calling.stream() for i in range(body.n)} if submitted.tool_calling else {}
        reasoning_streams: dict[int, ReasoningStream] = {}
        async for output in self.serving.outputs(submitted):
            for completion in output.outputs:
                if completion.error is not None:
                    yield sse(error_event(generation_failure(completion)))
                    continue
                index = completion.index
                logprobs = self._logprobs(completion.logprobs) if body.logprobs and completion.logprobs else None
                thinking, answer = "", completion.text
                if self.serving.reasoning_parser is not None:  # the thinking first; tool calls in the answer only
                    if index not in reasoning_streams:
                        reasoning_streams[index] = self.serving.reasoning_parser.stream(output.prompt)
                    split = reasoning_streams[index].feed(completion.text)
                    if completion.finished:
                        tail = reasoning_streams[index].finish()
                        split = ReasoningDelta(split.reasoning + tail.reasoning, split.content + tail.content)
                    thinking, answer = split.reasoning if body.include_reasoning else "", split.content
                deltas = [DeltaMessage(reasoning_content=thinking, reasoning=thinking)] if thinking else []
                tools = tool_streams.get(index)
                if tools is None:
                    deltas += [DeltaMessage(content=answer)] if answer else []
                else:
                    pieces = tools.feed(answer) + (tools.finish() if completion.finished else [])
                    deltas += [_tool_delta(piece) for piece in pieces]
                if logprobs and not deltas:
                    deltas = [DeltaMessage(content="")] if tools is None else [DeltaMessage()]
                for position, delta in enumerate(deltas):
                    yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs if position == 0 else None)])
                if completion.finished:
                    finish_reason = completion.finish_reason
                    if tools is not None and tools.sent_tool_calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
                    yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=finish_reason,
                                                 stop_reason=completion.stop_reason)])
        if body.include_usage:
            final = ChatCompletionChunk(id=submitted.response_id, model=self.serving.model_name, choices=[],
                                        usage=submitted.usage())
            yield sse(final.model_dump())
        yield "data: [DONE]\n\n"
        submitted.log()


def _tool_delta(piece: Delta) -> DeltaMessage:
    if isinstance(piece, ToolCallDelta):
        return DeltaMessage(tool_calls=[piece.to_openai()])
    return DeltaMessage(content=piece.text)

