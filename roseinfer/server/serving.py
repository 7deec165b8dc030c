"""From OpenAI request bodies to engine requests, and from `RequestOutput`s to OpenAI responses:
the streamed and whole responses of /v1/completions, /v1/chat/completions and the seed's /generate.

It talks to the engine only through `AsyncLLM`; every check of the prompt and the sampling
parameters happens in the engine's input processor, once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from roseinfer.engine.async_llm import AsyncLLM, NewRequest, RequestOutputStream
from roseinfer.errors import InvalidRequestError
from roseinfer.input_processor import ChatPrompt
from roseinfer.outputs import CompletionOutput, RequestOutput, TokenLogprob
from roseinfer.reasoning import ReasoningDelta, ReasoningStream
from roseinfer.sampling_params import RequestOutputKind, SamplingParams
from roseinfer.server.error_responses import (
    GenerationError,
    error_event,
    generation_failure,
    status_of,
)
from roseinfer.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    GenerateRequest,
    PromptTokensDetails,
    SamplingFields,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
    new_id,
)
from roseinfer.server.tool_calling import ToolCalling, tool_calling_for
from roseinfer.structured_output import StructuredOutputsParams
from roseinfer.tool_parsers import Delta, ToolCallDelta

logger = logging.getLogger("roseinfer.server")


def structured_outputs_of(body: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint `response_format` or vLLM's `structured_outputs` asks for (not both)."""
    constraint = None
    if body.structured_outputs is not None:
        constraint = StructuredOutputsParams.from_dict(body.structured_outputs)
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        if constraint is not None:
            raise InvalidRequestError("give response_format or structured_outputs, not both", "response_format")
        if response_format.type == "json_object":
            constraint = StructuredOutputsParams(json_object=True)
            constraint.param = "response_format"
        else:
            constraint = StructuredOutputsParams(json=response_format.json_schema.schema_)
            constraint.param = "response_format.json_schema.schema"
    return constraint


def sampling_params(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    return SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty or 1.0,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens if max_tokens is None else min(body.min_tokens, max_tokens),
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
        logit_bias=body.logit_bias,
        structured_outputs=structured_outputs,
        thinking_token_budget=body.thinking_token_budget,
    )


@dataclass
class Submitted:
    """The engine requests one HTTP request became (one per prompt) and their shared stream."""

    route: str
    response_id: str
    request_ids: list[str]
    stream: RequestOutputStream
    n: int
    started: float = field(default_factory=time.monotonic)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)
    finish_reasons: list[str] = field(default_factory=list)
    grammar_seconds: float | None = None
    tool_calling: ToolCalling | None = None

    def position(self, output: RequestOutput) -> int:
        return self.request_ids.index(output.request_id)

    def choice_index(self, output: RequestOutput, completion: CompletionOutput) -> int:
        return self.position(output) * self.n + completion.index

    def count(self, output: RequestOutput) -> None:
        self.prompt_tokens[output.request_id] = len(output.prompt_token_ids)
        if output.metrics is not None:
            self.cached_tokens[output.request_id] = output.metrics.num_cached_tokens
            if output.metrics.grammar_compile_time is not None:
                self.grammar_seconds = output.metrics.grammar_compile_time
        for completion in output.outputs:
            self.completion_tokens += len(completion.token_ids)
            if completion.finished:
                self.finish_reasons.append(completion.finish_reason or "")

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        return Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                     total_tokens=prompt + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())))

    def log(self) -> None:
        grammar = f", grammar compiled in {1000 * self.grammar_seconds:.1f} ms" if self.grammar_seconds is not None else ""
        logger.info(
            "%s %s: %d prompt + %d completion tokens, finish %s, %.2fs%s",
            self.route, self.response_id, sum(self.prompt_tokens.values()), self.completion_tokens,
            ",".join(sorted(set(self.finish_reasons))) or "-", time.monotonic() - self.started, grammar,
        )


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = engine.reasoning_parser  # None: not a thinking model

    async def submit(
        self, route: str, prefix: str, requests: list[NewRequest], n: int, tool_calling: ToolCalling | None = None
    ) -> Submitted:
        """Queue the engine requests (raises InvalidRequestError, EngineOverloadedError, ...) before
        any response starts."""
        stream = await self.engine.add_requests(requests)
        return Submitted(route, new_id(prefix), [r.request_id for r in requests], stream, n, tool_calling=tool_calling)

    async def _outputs(self, submitted: Submitted) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving early (client gone) aborts the rest."""
        try:
            async for output in submitted.stream:
                submitted.count(output)
                yield output
        finally:
            if not submitted.stream.finished:
                submitted.stream.close()
                logger.info("%s %s: client went away; request aborted", submitted.route, submitted.response_id)

    async def _final_outputs(self, submitted: Submitted) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(submitted.request_ids)
        async for output in self._outputs(submitted):
            for completion in output.outputs:
                if completion.error is not None:
                    raise generation_failure(completion)
            finals[submitted.position(output)] = output
        return finals

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- /v1/completions -------------------------------------------------------------------
    def completion_requests(self, body: CompletionRequest) -> list[NewRequest]:
        if body.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        prompts = body.prompts()
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        params = sampling_params(body, body.max_tokens, body.logprobs, structured_outputs_of(body))
        return [NewRequest(new_id("cmpl"), prompt, params, cache_salt=body.cache_salt) for prompt in prompts]

    def _completion_logprobs(self, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for entry in entries:
            text = self._token_text(entry.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append({self._token_text(t): lp for t, lp in entry.top})
            result.text_offset.append(offset)
            offset += len(text)
        return result

    async def completion(self, body: CompletionRequest, submitted: Submitted) -> CompletionResponse:
        choices = []
        for output in await self._final_outputs(submitted):
            for completion in output.outputs:
                logprobs = None
                if body.logprobs is not None and completion.logprobs is not None:
                    logprobs = self._completion_logprobs(completion.logprobs, 0)
                choices.append(CompletionChoice(
                    index=submitted.choice_index(output, completion), text=completion.text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                ))
        submitted.log()
        return CompletionResponse(id=submitted.response_id, model=self.model_name, choices=choices,
                                  usage=submitted.usage())

    async def completion_stream(self, body: CompletionRequest, submitted: Submitted) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        async for output in self._outputs(submitted):
            for completion in output.outputs:
                index = submitted.choice_index(output, completion)
                if completion.error is not None:
                    yield _sse(error_event(generation_failure(completion)))
                    continue
                logprobs = None
                if body.logprobs is not None and completion.logprobs:
                    logprobs = self._completion_logprobs(completion.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(completion.text)
                if completion.text or completion.finished or logprobs:
                    chunk = CompletionResponse(id=submitted.response_id, model=self.model_name, choices=[
                        CompletionChoice(index=index, text=completion.text, logprobs=logprobs,
                                         finish_reason=completion.finish_reason,
                                         stop_reason=completion.stop_reason),
                    ])
                    yield _sse(chunk.model_dump(exclude={"usage"}))
        if body.include_usage:
            final = CompletionResponse(id=submitted.response_id, model=self.model_name, choices=[],
                                       usage=submitted.usage())
            yield _sse(final.model_dump())
        yield "data: [DONE]\n\n"
        submitted.log()

    # -- /v1/chat/completions --------------------------------------------------------------
    def chat_requests(self, body: ChatCompletionRequest) -> tuple[list[NewRequest], ToolCalling | None]:
        tool_calling = tool_calling_for(body, self.tool_call_parser)
        constraint = structured_outputs_of(body)
        if tool_calling is not None and tool_calling.structured_outputs is not None:
            if constraint is not None:
                raise InvalidRequestError(
                    "tool_choice required or a named function already constrains the output; "
                    "leave response_format and structured_outputs out", "tool_choice",
                )
            constraint = tool_calling.structured_outputs
        chat = ChatPrompt(
            [m.model_dump(exclude_none=True) for m in body.messages], body.add_generation_prompt,
            body.chat_template_kwargs,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None,
            parse_special_tokens_in_messages=body.parse_special_tokens_in_messages,
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, body.completion_limit, logprobs, constraint)
        return [NewRequest(new_id("chatcmpl"), chat, params, cache_salt=body.cache_salt)], tool_calling

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in entries:
            text = self._token_text(entry.token_id)
            top = [TopLogprob(token=(t := self._token_text(i)), logprob=lp, bytes=list(t.encode()))
                   for i, lp in entry.top]
            content.append(TokenLogprobEntry(token=text, logprob=entry.logprob, bytes=list(text.encode()),
                                             top_logprobs=top))
        return ChatLogprobs(content=content)

    async def chat(self, body: ChatCompletionRequest, submitted: Submitted) -> ChatCompletionResponse:
        (output,) = await self._final_outputs(submitted)
        choices = []
        for c in output.outputs:
            answer, reasoning = c.text, None
            if self.reasoning_parser is not None:  # tool calls are read from the answer only
                split = self.reasoning_parser.split(c.text, output.prompt)
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
                logprobs=self._chat_logprobs(c.logprobs) if body.logprobs and c.logprobs is not None else None,
                finish_reason=finish_reason, stop_reason=c.stop_reason,
            ))
        submitted.log()
        return ChatCompletionResponse(id=submitted.response_id, model=self.model_name, choices=choices,
                                      usage=submitted.usage())

    async def chat_stream(self, body: ChatCompletionRequest, submitted: Submitted) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice]) -> str:
            payload = ChatCompletionChunk(id=submitted.response_id, model=self.model_name,
                                          choices=choices).model_dump(exclude={"usage"})
            for choice in payload["choices"]:  # a delta carries only what changed, as OpenAI's do
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return _sse(payload)

        # The role comes first, once per choice, as OpenAI sends it.
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(body.n)])
        tool_streams = {i: submitted.tool_calling.stream() for i in range(body.n)} if submitted.tool_calling else {}
        reasoning_streams: dict[int, ReasoningStream] = {}
        async for output in self._outputs(submitted):
            for completion in output.outputs:
                if completion.error is not None:
                    yield _sse(error_event(generation_failure(completion)))
                    continue
                index = completion.index
                logprobs = self._chat_logprobs(completion.logprobs) if body.logprobs and completion.logprobs else None
                thinking, answer = "", completion.text
                if self.reasoning_parser is not None:  # the thinking first; tool calls in the answer only
                    if index not in reasoning_streams:
                        reasoning_streams[index] = self.reasoning_parser.stream(output.prompt)
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
            final = ChatCompletionChunk(id=submitted.response_id, model=self.model_name, choices=[],
                                        usage=submitted.usage())
            yield _sse(final.model_dump())
        yield "data: [DONE]\n\n"
        submitted.log()

    # -- the seed's /generate --------------------------------------------------------------
    def generate_requests(self, body: GenerateRequest) -> list[NewRequest]:
        params = SamplingParams.from_seed_args(
            body.max_new_tokens, body.temperature, body.top_k, body.top_p, body.stop_on_eos, body.do_sample, body.seed,
        )
        params.output_kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        return [NewRequest(new_id("gen"), body.prompt, params)]

    async def generate(self, submitted: Submitted) -> dict:
        (output,) = await self._final_outputs(submitted)
        completion = output.outputs[0]
        submitted.log()
        return {"text": completion.text, "finish_reason": completion.finish_reason,
                "prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(completion.token_ids)}

    async def generate_stream(self, submitted: Submitted) -> AsyncIterator[str]:
        async for output in self._outputs(submitted):
            for completion in output.outputs:
                if completion.error is not None:
                    raise generation_failure(completion)
                if completion.text:
                    yield completion.text
        submitted.log()


def _tool_delta(piece: Delta) -> DeltaMessage:
    if isinstance(piece, ToolCallDelta):
        return DeltaMessage(tool_calls=[piece.to_openai()])
    return DeltaMessage(content=piece.text)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def guarded_sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events. If its request fails once the response has started (the engine stopped,
    the time limit, a shutdown, a bug), an error event and [DONE] end it: the client hears why, and
    the HTTP response still ends properly."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        _log_stream_failure(exc)
        yield _sse(error_event(exc))
        yield "data: [DONE]\n\n"


async def guarded_text(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The seed's plain-text stream; a failure after the start ends it with a line `[error] ...`."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        _log_stream_failure(exc)
        yield f"\n[error] {error_event(exc)['error']['message']}\n"


def _log_stream_failure(exc: Exception) -> None:
    if status_of(exc) == 500 and not isinstance(exc, GenerationError):
        logger.exception("a stream failed")
    else:
        logger.info("a stream ended early: %s", exc)
