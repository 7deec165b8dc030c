"""The seed's POST /generate: one prompt with the seed's sampling fields; the whole text as JSON,
or with `stream: true` the text as it is generated (plain text)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from roseinfer.engine.async_llm import NewRequest
from roseinfer.sampling_params import RequestOutputKind, SamplingParams
from roseinfer.server.api_family import ApiContext, unless_disconnected
from roseinfer.server.error_responses import error_event, generation_failure
from roseinfer.server.openapi import errors
from roseinfer.server.protocol import GenerateRequest, GenerateResponse, new_id
from roseinfer.server.serving import OpenAIServing, Submitted, log_stream_failure

ROUTE = "/generate"


def generate_request(body: GenerateRequest) -> NewRequest:
    params = SamplingParams.from_seed_args(
        body.max_new_tokens, body.temperature, body.top_k, body.top_p, body.stop_on_eos, body.do_sample, body.seed,
    )
    params.output_kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    return NewRequest(new_id("gen"), body.prompt, params)


async def whole_text(serving: OpenAIServing, submitted: Submitted) -> dict:
    (output,) = await serving.final_outputs(submitted)
    completion = output.outputs[0]
    submitted.log()
    return {"text": completion.text, "finish_reason": completion.finish_reason,
            "prompt_tokens": len(output.prompt_token_ids), "completion_tokens": len(completion.token_ids)}


async def text_stream(serving: OpenAIServing, submitted: Submitted) -> AsyncIterator[str]:
    async for output in serving.outputs(submitted):
        for completion in output.outputs:
            if completion.error is not None:
                raise generation_failure(completion)
            if completion.text:
                yield completion.text
    submitted.log()


async def guarded_text(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The seed's plain-text stream; a failure after the start ends it with a line `[error] ...`."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        log_stream_failure(exc)
        yield f"\n[error] {error_event(exc)['error']['message']}\n"


def register(app: FastAPI, context: ApiContext) -> None:
    serving = context.serving
    router = APIRouter()

    @router.post(ROUTE, responses={200: {
        "model": GenerateResponse,
        "description": "The whole response; with `stream: true`, the text as it is generated (plain "
                       "text; a request that fails after the stream has started ends with a line "
                       "`[error] <message>`).",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }} | errors(400, 401, 408, 413, 500, 503))
    async def generate(body: GenerateRequest, request: Request) -> Response:
        submitted = await serving.submit(ROUTE, "gen", [generate_request(body)], 1)
        if body.stream:
            return StreamingResponse(guarded_text(text_stream(serving, submitted)),
                                     media_type="text/plain; charset=utf-8")
        return await unless_disconnected(request, whole_text(serving, submitted))

    app.include_router(router)
