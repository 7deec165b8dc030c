"""The request -> engine plumbing every generation route shares: OpenAI sampling fields to
`SamplingParams`, a chat body to its engine request, queuing (`submit`), the outputs as they come,
and the server-sent-event framing. Each API family renders the outputs in its own module
(completions_serving, chat_serving, generate_api, responses_api, anthropic_serving).

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
from roseinfer.engine.input_processor import ChatPrompt
from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import CompletionOutput, RequestOutput
from roseinfer.sampling_params import RequestOutputKind, SamplingParams
from roseinfer.server.effort import effort_fields, effort_of_budget
from roseinfer.server.error_responses import (
    GenerationError,
    error_event,
    generation_failure,
    status_of,
)
from roseinfer.server.protocol import (
    ChatCompletionRequest,
    PromptTokensDetails,
    SamplingFields,
    Usage,
    new_id,
)
from roseinfer.server.tool_calling import ToolCalling, tool_calling_for
from roseinfer.structured_output import StructuredOutputsParams
from roseinfer.tool_parsers import detect_tool_parser

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
    """The engine as the API families reach it (one per app, shared by all of them)."""

    def __init__(self, engine: AsyncLLM, model_name: str, tool_call_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        # A model whose own format renders its prompts (gpt-oss: harmony), None: its chat template.
        self.chat_format = engine.chat_format
        # tool_choice "auto": the format --tool-call-parser names, else the chat format's, else the
        # one the template writes.
        if tool_call_parser is None and self.chat_format is not None:
            tool_call_parser = self.chat_format.tool_parser
            logger.info("tool calls: the %s format's (tool parser %r)", self.chat_format.name, tool_call_parser)
        elif tool_call_parser is None:
            tool_call_parser, found = detect_tool_parser(getattr(self.tokenizer, "chat_template", None))
            logger.info("%s", found)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = engine.reasoning_parser  # None: not a thinking model
        # A vision-language model takes image parts; a text model refuses them (a 400 naming the part).
        self.takes_images = engine.input_processor.prompt_images is not None

    async def submit(
        self, route: str, prefix: str, requests: list[NewRequest], n: int, tool_calling: ToolCalling | None = None
    ) -> Submitted:
        """Queue the engine requests (raises InvalidRequestError, EngineOverloadedError, ...) before
        any response starts."""
        stream = await self.engine.add_requests(requests)
        return Submitted(route, new_id(prefix), [r.request_id for r in requests], stream, n, tool_calling=tool_calling)

    async def outputs(self, submitted: Submitted) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving early (client gone) aborts the rest."""
        try:
            async for output in submitted.stream:
                submitted.count(output)
                yield output
        finally:
            if not submitted.stream.finished:
                submitted.stream.close()
                logger.info("%s %s: client went away; request aborted", submitted.route, submitted.response_id)

    async def final_outputs(self, submitted: Submitted) -> list[RequestOutput]:
        """Each prompt's last output, in prompt order (GenerationError if a sequence failed)."""
        finals: list[RequestOutput | None] = [None] * len(submitted.request_ids)
        async for output in self.outputs(submitted):
            for completion in output.outputs:
                if completion.error is not None:
                    raise generation_failure(completion)
            finals[submitted.position(output)] = output
        return finals

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_requests(self, body: ChatCompletionRequest) -> tuple[list[NewRequest], ToolCalling | None]:
        """The engine request of a chat body (the chat route's; /tokenize and the Messages API
        build theirs with it too, so all three feed the same prompt), and its tool calling."""
        tool_calling = tool_calling_for(body, self.tool_call_parser)
        constraint = structured_outputs_of(body)
        if tool_calling is not None and tool_calling.structured_outputs is not None:
            if constraint is not None:
                raise InvalidRequestError(
                    "tool_choice required or a named function already constrains the output; "
                    "leave response_format and structured_outputs out", "tool_choice",
                )
            constraint = tool_calling.structured_outputs
        body, effort = self.with_effort(body)
        chat = ChatPrompt(
            [m.model_dump(exclude_none=True) for m in body.messages], body.add_generation_prompt,
            body.chat_template_kwargs or None,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None,
            parse_special_tokens_in_messages=body.parse_special_tokens_in_messages,
            reasoning_effort=effort,
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, body.completion_limit, logprobs, constraint)
        self.keep_special_tokens(params, tool_calling)
        return [NewRequest(new_id("chatcmpl"), chat, params, cache_salt=body.cache_salt)], tool_calling

    def with_effort(self, body: ChatCompletionRequest) -> tuple[ChatCompletionRequest, str | None]:
        """The body with its reasoning effort applied, and the effort the prompt itself carries.
        A chat template's thinking model: the effort becomes a thinking budget or the template's
        enable_thinking (effort.py). A chat format's (harmony's reasoning level): the effort goes
        into the prompt, and a thinking budget or enable_thinking=false is read as the nearest
        effort, since harmony's thinking has no token to close it by."""
        if self.chat_format is not None and self.reasoning_parser is not None:
            kwargs = dict(body.chat_template_kwargs or {})
            thinking = kwargs.pop("enable_thinking", None)
            effort = body.reasoning_effort
            if effort is None and body.thinking_token_budget is not None:
                effort = effort_of_budget(body.thinking_token_budget)
            if effort is None and thinking is False:
                effort = "none"
            return body.model_copy(update={"thinking_token_budget": None, "chat_template_kwargs": kwargs}), effort
        if body.reasoning_effort is not None and self.reasoning_parser is not None:
            effort = effort_fields(body.reasoning_effort)
            body = body.model_copy(update={
                "thinking_token_budget": body.thinking_token_budget if body.thinking_token_budget is not None
                else effort.get("thinking_token_budget"),
                "chat_template_kwargs": effort.get("chat_template_kwargs", {}) | (body.chat_template_kwargs or {})})
        return body, None

    def keep_special_tokens(self, params: SamplingParams, tool_calling: ToolCalling | None) -> None:
        """Keep special tokens in the output text where a parser reads them (harmony's channels,
        Mistral's [TOOL_CALLS])."""
        if (tool_calling is not None and tool_calling.keeps_special_tokens) or \
                (self.reasoning_parser is not None and self.reasoning_parser.keeps_special_tokens):
            params.skip_special_tokens = False


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def guarded_sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events. If its request fails once the response has started (the engine stopped,
    the time limit, a shutdown, a bug), an error event and [DONE] end it: the client hears why, and
    the HTTP response still ends properly."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        log_stream_failure(exc)
        yield sse(error_event(exc))
        yield "data: [DONE]\n\n"


def log_stream_failure(exc: Exception) -> None:
    """A bug with its traceback; an expected end (time limit, shutdown, a failed step) in one line."""
    if status_of(exc) == 500 and not isinstance(exc, GenerationError):
        logger.exception("a stream failed")
    else:
        logger.info("a stream ended early: %s", exc)
