"""/v1/completions: a completion body to its engine requests (one per prompt), and their outputs
to OpenAI's CompletionResponse, whole or as a stream of chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from roseinfer.engine.async_llm import NewRequest
from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import TokenLogprob
from roseinfer.server.error_responses import error_event, generation_failure
from roseinfer.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    new_id,
)
from roseinfer.server.serving import (
    OpenAIServing,
    Submitted,
    sampling_params,
    sse,
    structured_outputs_of,
)


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def requests(self, body: CompletionRequest) -> list[NewRequest]:
        """One engine request per prompt (a list of prompts answers with n choices each)."""
        if body.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        prompts = body.prompts()
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        params = sampling_params(body, body.max_tokens, body.logprobs, structured_outputs_of(body))
        return [NewRequest(new_id("cmpl"), prompt, params, cache_salt=body.cache_salt) for prompt in prompts]

    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for entry in entries:
            text = self.serving.token_text(entry.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(entry.logprob)
            result.top_logprobs.append({self.serving.token_text(t): lp for t, lp in entry.top})
            result.text_offset.append(offset)
            offset += len(text)
        return result

    async def response(self, body: CompletionRequest, submitted: Submitted) -> CompletionResponse:
        choices = []
        for output in await self.serving.final_outputs(submitted):
            for completion in output.outputs:
                logprobs = None
                if body.logprobs is not None and completion.logprobs is not None:
                    logprobs = self._logprobs(completion.logprobs, 0)
                choices.append(CompletionChoice(
                    index=submitted.choice_index(output, completion), text=completion.text, logprobs=logprobs,
                    finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                ))
        submitted.log()
        return CompletionResponse(id=submitted.response_id, model=self.serving.model_name, choices=choices,
                                  usage=submitted.usage())

    async def stream(self, body: CompletionRequest, submitted: Submitted) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}
        async for output in self.serving.outputs(submitted):
            for completion in output.outputs:
                index = submitted.choice_index(output, completion)
                if completion.error is not None:
                    yield sse(error_event(generation_failure(completion)))
                    continue
                logprobs = None
                if body.logprobs is not None and completion.logprobs:
                    logprobs = self._logprobs(completion.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(completion.text)
                if completion.text or completion.finished or logprobs:
                    chunk = CompletionResponse(id=submitted.response_id, model=self.serving.model_name, choices=[
                        CompletionChoice(index=index, text=completion.text, logprobs=logprobs,
                                         finish_reason=completion.finish_reason,
                                         stop_reason=completion.stop_reason),
                    ])
                    yield sse(chunk.model_dump(exclude={"usage"}))
        if body.include_usage:
            final = CompletionResponse(id=submitted.response_id, model=self.serving.model_name, choices=[],
                                       usage=submitted.usage())
            yield sse(final.model_dump())
        yield "data: [DONE]\n\n"
        submitted.log()
