"""POST /v1/embeddings in OpenAI's shape: one vector per input (a string, strings, token ids or
lists of token ids), as float lists or base64 of little-endian float32. Each input becomes a
pooling request (`PoolingParams`) through the same input processor, engine and output processor
as generation (prefill only); the server's --pooling / --no-normalize choose how its hidden states
become the vector. Errors are OpenAI's error object; the API key and every limit of the other
routes apply (body size, prompt characters, the context, the queue, the request time limit)."""

from __future__ import annotations

import base64
import logging
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, field_validator

from roseinfer.engine.async_llm import AsyncLLM, NewRequest, RequestOutputStream
from roseinfer.errors import InvalidRequestError
from roseinfer.outputs import PoolingRequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.server.api_family import ApiContext, unless_disconnected
from roseinfer.server.error_responses import GenerationError
from roseinfer.server.openapi import errors
from roseinfer.server.protocol import StrictModel, TokenIds, new_id

logger = logging.getLogger("roseinfer.server")

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
_PROMPT_PARAMS = ("prompt", "prompt_token_ids", "messages")  # the input processor's names for `input`
_INPUT_SHAPES = "a non-empty string, a list of them, a list of token ids, or a list of lists of token ids"

Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[TokenIds, Field(min_length=1)]


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] | Ids
            | Annotated[list[Ids], Field(min_length=1, max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # the first this many values, normalized again
    user: str | None = None
    normalize: bool | None = None  # vLLM's: override the server's --normalize / --no-normalize

    @field_validator("input", mode="before")
    @classmethod
    def _one_of_the_shapes(cls, value: Any) -> Any:
        """The shapes checked here, so that a bad one is one message naming `input` (rather than
        one error per member of the union)."""
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be an empty string")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"must be {_INPUT_SHAPES}")
        if len(value) > MAX_INPUTS:
            raise ValueError(f"has {len(value)} items, more than the limit of {MAX_INPUTS}")
        if all(isinstance(item, str) for item in value):
            if not all(value):
                raise ValueError("must not hold an empty string")
        elif all(isinstance(item, list) for item in value):
            if not all(item and all(_is_token_id(t) for t in item) for item in value):
                raise ValueError("a list of lists of token ids needs non-empty lists of integers >= 0")
        elif not all(_is_token_id(item) for item in value):
            raise ValueError(f"must be {_INPUT_SHAPES}")
        return value

    def prompts(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or isinstance(value[0], int):
            return [value]
        return list(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


async def submit_inputs(engine: AsyncLLM, prompts: list[str | list[int]], params: PoolingParams) -> tuple[
        list[str], RequestOutputStream]:
    """One pooling request per input, queued together (an error names `input`)."""
    limit = engine.max_queue_len
    if limit is not None and len(prompts) > limit:  # could never be queued: not a 503 to retry
        raise InvalidRequestError(f"input has {len(prompts)} items, more than this server queues at once "
                                  f"({limit}, --max-queue-len); send them in smaller requests", "input")
    requests = [NewRequest(new_id("embd"), prompt, params) for prompt in prompts]
    try:
        stream = await engine.add_requests(requests)
    except InvalidRequestError as exc:
        if exc.param in _PROMPT_PARAMS:  # the input processor's name for it
            exc.param = "input"
        raise
    return [r.request_id for r in requests], stream


async def collect(ids: list[str], stream: RequestOutputStream) -> list[PoolingRequestOutput]:
    """Each input's finished output, in input order (leaving early aborts the rest)."""
    finals: dict[str, PoolingRequestOutput] = {}
    try:
        async for output in stream:
            if not output.finished:
                continue
            if output.outputs is None:
                raise GenerationError(f"embedding failed: {output.error or output.finish_reason}")
            finals[output.request_id] = output
    finally:
        if not stream.finished:
            stream.close()
    return [finals[i] for i in ids]


async def embed_inputs(engine: AsyncLLM, prompts: list[str | list[int]], normalize: bool | None = None,
                       dimensions: int | None = None) -> tuple[list[Any], int]:
    """The vectors of `prompts` (numpy arrays, in order) and their prompt tokens in all (the Ollama
    API's /api/embed takes them so)."""
    ids, stream = await submit_inputs(engine, prompts, PoolingParams(normalize=normalize, dimensions=dimensions))
    outputs = await collect(ids, stream)
    return [o.outputs.data for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)


def register(app: FastAPI, context: ApiContext) -> None:
    serving, check_model = context.serving, context.check_model
    engine = serving.engine
    router = APIRouter(tags=["Embeddings"])

    async def submit(body: EmbeddingRequest) -> tuple[list[str], RequestOutputStream]:
        params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
        return await submit_inputs(engine, body.prompts(), params)

    async def respond(body: EmbeddingRequest, ids: list[str], stream: RequestOutputStream) -> EmbeddingResponse:
        started, response_id = time.monotonic(), new_id("embd")
        outputs = await collect(ids, stream)
        finals = dict(zip(ids, outputs, strict=True))
        data = []
        for index, request_id in enumerate(ids):
            vector = finals[request_id].outputs.data
            embedding = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                         if body.encoding_format == "base64" else vector.tolist())
            data.append(Embedding(index=index, embedding=embedding))
        tokens = sum(len(finals[i].prompt_token_ids) for i in ids)
        logger.info("/v1/embeddings %s: %d inputs, %d prompt tokens, %.2fs", response_id, len(ids), tokens,
                    time.monotonic() - started)
        return EmbeddingResponse(data=data, model=serving.model_name,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    @router.post("/v1/embeddings", responses=errors(400, 401, 404, 408, 413, 500, 503))
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        """One vector per input: the final-norm hidden states of its tokens pooled (the server's
        --pooling: the last token's, or their mean), truncated to `dimensions`, L2-normalized
        (unless --no-normalize or `normalize: false`)."""
        check_model(body.model)
        ids, stream = await submit(body)
        result: Response = await unless_disconnected(request, respond(body, ids, stream))
        return result

    app.include_router(router)
