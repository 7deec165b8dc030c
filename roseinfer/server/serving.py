"""From OpenAI requests to engine requests and back: sampling parameters, context checks, and the
streamed or whole responses of /v1/completions, /v1/chat/completions and the seed's /generate.
It talks to the engine only through the SchedulerManager."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import OutputDelta, RequestOutput, TokenLogprob
from roseinfer.sampling_params import SamplingParams
from roseinfer.server.manager import SchedulerManager
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

logger = logging.getLogger("roseinfer.server")


class ContextLengthError(InvalidRequestError):
    """The prompt plus the tokens asked for do not fit in the model's context."""


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
        min_tokens=min(body.min_tokens, max_tokens),
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


@dataclass
class Submitted:
    """The engine requests one HTTP request became (one per prompt) and what is known of them."""

    ids: list[int]
    prompt_lengths: list[int]
    n: int
    started: float = field(default_factory=time.monotonic)

    def choice_index(self, position: int, delta: OutputDelta) -> int:
        return position * self.n + delta.index


class OpenAIServing:
    def __init__(self, manager: SchedulerManager, model_name: str) -> None:
        self.manager = manager
        self.engine = manager.engine
        self.tokenizer = manager.engine.tokenizer
        self.model_name = model_name

    # -- shared ---------------------------------------------------------------------------
    def _fit(self, prompt_ids: list[int], requested: int | None, prompt_param: str) -> int:
        """The completion limit for a prompt: the one asked for, which must fit in the context,
        or all the room that is left."""
        limit = self.engine.max_model_len
        if len(prompt_ids) >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(prompt_ids)} tokens, which leaves no room for a completion.", prompt_param,
            )
        if requested is None:
            return limit - len(prompt_ids)
        if len(prompt_ids) + requested > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + requested} tokens ({len(prompt_ids)} in the prompt, {requested} "
                "for the completion). Please reduce the prompt or max_tokens.", "max_tokens",
            )
        return requested

    def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> Submitted:
        """Queue the engine requests (503 if the queue is full); before any response starts."""
        self.manager.check_capacity(len(prompts))
        ids: list[int] = []
        try:
            for prompt_ids, p in zip(prompts, params, strict=True):
                ids.append(self.manager.add(prompt_ids, p))
        except Exception:
            for request_id in ids:
                self.manager.abort(request_id)
            raise
        return Submitted(ids, [len(p) for p in prompts], params[0].n)

    async def _merged(self, submitted: Submitted) -> AsyncIterator[tuple[int, OutputDelta]]:
        """Deltas of every engine request of one HTTP request, as they come, with the prompt's
        position. Leaving early (client gone) aborts all of them."""
        streams = [self.manager.stream(request_id) for request_id in submitted.ids]
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    position = pending.pop(task)
                    try:
                        delta = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(anext(streams[position]))] = position
                    yield position, delta
        finally:
            for task in pending:
                task.cancel()
            for stream in streams:
                await stream.aclose()

    def _usage(self, submitted: Submitted, outputs: list[RequestOutput | None]) -> Usage:
        prompt = sum(submitted.prompt_lengths)
        completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
        cached = sum(o.metrics.num_cached_tokens for o in outputs if o is not None and o.metrics)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _log(self, route: str, request_id: str, submitted: Submitted, usage: Usage | None, reasons: list[str]) -> None:
        logger.info(
            "%s %s: %d prompt + %d completion tokens, finish %s, %.2fs",
            route, request_id, usage.prompt_tokens if usage else sum(submitted.prompt_lengths),
            usage.completion_tokens if usage else 0, ",".join(sorted(set(reasons))) or "-",
            time.monotonic() - submitted.started,
        )

    @staticmethod
    def _raise_error(delta: OutputDelta) -> None:
        if delta.error is not None:
            raise RuntimeError(f"generation failed: {delta.error}")

    # -- /v1/completions -------------------------------------------------------------------
    def prepare_completion(self, body: CompletionRequest) -> tuple[list[list[int]], list[SamplingParams]]:
        if body.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        prompts: list[list[int]] = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompts.append(self.engine.prompt_token_ids(prompt, None))
            else:
                prompts.append(self.engine.prompt_token_ids(None, prompt))
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        params = [sampling_params(body, self._fit(p, body.max_tokens, "prompt"), body.logprobs) for p in prompts]
        return prompts, params

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
        request_id = new_id("cmpl")
        outputs: list[RequestOutput | None] = [None] * len(submitted.ids)
        async for position, delta in self._merged(submitted):
            self._raise_error(delta)
            if delta.output is not None:
                outputs[position] = delta.output
        choices = []
        for position, output in enumerate(outputs):
            for completion in output.outputs:
                logprobs = None
                if body.logprobs is not None and completion.logprobs is not None:
                    logprobs = self._completion_logprobs(completion.logprobs, 0)
                choices.append(CompletionChoice(
                    index=position * body.n + completion.index, text=completion.text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                ))
        usage = self._usage(submitted, outputs)
        self._log("/v1/completions", request_id, submitted, usage, [c.finish_reason or "" for c in choices])
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def completion_stream(self, body: CompletionRequest, submitted: Submitted) -> AsyncIterator[str]:
        request_id = new_id("cmpl")
        outputs: list[RequestOutput | None] = [None] * len(submitted.ids)
        offsets: dict[int, int] = {}
        reasons: list[str] = []
        try:
            async for position, delta in self._merged(submitted):
                index = submitted.choice_index(position, delta)
                logprobs = None
                if body.logprobs is not None and delta.logprobs:
                    logprobs = self._completion_logprobs(delta.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(delta.text)
                if delta.error is not None:
                    yield _sse({"error": {"message": delta.error, "type": "server_error", "param": None,
                                          "code": 500}})
                    reasons.append("error")
                    continue
                if delta.text or delta.finished or logprobs:
                    chunk = CompletionResponse(id=request_id, model=self.model_name, choices=[CompletionChoice(
                        index=index, text=delta.text, logprobs=logprobs,
                        finish_reason=delta.finish_reason if delta.finished else None,
                        stop_reason=delta.stop_reason if delta.finished else None,
                    )])
                    yield _sse(chunk.model_dump(exclude={"usage"}))
                if delta.finished:
                    reasons.append(delta.finish_reason or "")
                if delta.output is not None:
                    outputs[position] = delta.output
            usage = self._usage(submitted, outputs)
            if body.include_usage:
                final = CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage)
                yield _sse(final.model_dump())
            yield "data: [DONE]\n\n"
            self._log("/v1/completions", request_id, submitted, usage, reasons)
        finally:
            if None in outputs:
                logger.info("/v1/completions %s: client went away; request aborted", request_id)

    # -- /v1/chat/completions --------------------------------------------------------------
    def prepare_chat(self, body: ChatCompletionRequest) -> tuple[list[list[int]], list[SamplingParams]]:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        for message in messages:
            if isinstance(message.get("content"), list):
                message["content"] = "".join(part["text"] for part in message["content"])
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, **(body.chat_template_kwargs or {})
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "messages") from exc
        prompt_ids = self.engine.prompt_token_ids(None, self.tokenizer.encode(text, add_special_tokens=False))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return [prompt_ids], [sampling_params(body, self._fit(prompt_ids, body.completion_limit, "messages"), logprobs)]

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
        request_id = new_id("chatcmpl")
        output: RequestOutput | None = None
        async for _, delta in self._merged(submitted):
            self._raise_error(delta)
            if delta.output is not None:
                output = delta.output
        choices = [
            ChatChoice(
                index=c.index, message=AssistantMessage(content=c.text),
                logprobs=self._chat_logprobs(c.logprobs) if body.logprobs and c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            )
            for c in output.outputs
        ]
        usage = self._usage(submitted, [output])
        self._log("/v1/chat/completions", request_id, submitted, usage, [c.finish_reason or "" for c in choices])
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def chat_stream(self, body: ChatCompletionRequest, submitted: Submitted) -> AsyncIterator[str]:
        request_id = new_id("chatcmpl")
        output: RequestOutput | None = None
        reasons: list[str] = []

        def chunk(choices: list[ChatChunkChoice]) -> str:
            payload = ChatCompletionChunk(id=request_id, model=self.model_name, choices=choices).model_dump(
                exclude={"usage"}
            )
            for choice in payload["choices"]:  # a delta carries only what changed, as OpenAI's do
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return _sse(payload)

        try:
            # The role comes first, once per choice, as OpenAI sends it.
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(body.n)])
            async for _, delta in self._merged(submitted):
                if delta.error is not None:
                    yield _sse({"error": {"message": delta.error, "type": "server_error", "param": None,
                                          "code": 500}})
                    reasons.append("error")
                    continue
                logprobs = self._chat_logprobs(delta.logprobs) if body.logprobs and delta.logprobs else None
                if delta.text or logprobs:
                    yield chunk([ChatChunkChoice(index=delta.index, delta=DeltaMessage(content=delta.text),
                                                 logprobs=logprobs)])
                if delta.finished:
                    reasons.append(delta.finish_reason or "")
                    yield chunk([ChatChunkChoice(index=delta.index, delta=DeltaMessage(),
                                                 finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
                if delta.output is not None:
                    output = delta.output
            usage = self._usage(submitted, [output])
            if body.include_usage:
                final = ChatCompletionChunk(id=request_id, model=self.model_name, choices=[], usage=usage)
                yield _sse(final.model_dump())
            yield "data: [DONE]\n\n"
            self._log("/v1/chat/completions", request_id, submitted, usage, reasons)
        finally:
            if output is None:
                logger.info("/v1/chat/completions %s: client went away; request aborted", request_id)

    # -- the seed's /generate --------------------------------------------------------------
    def prepare_generate(self, body: GenerateRequest) -> tuple[list[list[int]], list[SamplingParams]]:
        prompt_ids = self.engine.prompt_token_ids(body.prompt, None)
        params = SamplingParams.from_seed_args(
            self._fit(prompt_ids, body.max_new_tokens, "prompt"), body.temperature, body.top_k, body.top_p,
            body.stop_on_eos, body.do_sample, body.seed,
        )
        return [prompt_ids], [params]

    async def generate(self, submitted: Submitted) -> dict:
        output: RequestOutput | None = None
        async for _, delta in self._merged(submitted):
            self._raise_error(delta)
            if delta.output is not None:
                output = delta.output
        completion = output.outputs[0]
        self._log("/generate", str(submitted.ids[0]), submitted, None, [completion.finish_reason or ""])
        return {"text": completion.text, "finish_reason": completion.finish_reason,
                "prompt_tokens": submitted.prompt_lengths[0], "completion_tokens": len(completion.token_ids)}

    async def generate_stream(self, submitted: Submitted) -> AsyncIterator[str]:
        async for _, delta in self._merged(submitted):
            self._raise_error(delta)
            if delta.text:
                yield delta.text


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
