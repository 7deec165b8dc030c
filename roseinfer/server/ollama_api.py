"""Ollama's API on the same server (the clients of VS Code, Open WebUI, Home Assistant and the
official `ollama` libraries speak only it): POST /api/chat and /api/generate (streamed NDJSON by
default, or one object with stream: false), /api/embed, /api/show, /api/pull; GET /api/tags,
/api/ps and /api/version.

A chat (or a templated generate) becomes the chat completion request it means and goes through
the same engine path as /v1/chat/completions (a raw generate: as /v1/completions), so that the
answers are the same tokens; the outputs are rendered in Ollama's shape here. Options are mapped in
ollama_protocol.py. Every error on these routes is Ollama's {"error": "message"}, with the status
the OpenAI routes would answer; an error after a stream started is a last {"error": ...} line.
The API key guards these routes exactly as the OpenAI ones (Authorization: Bearer, which the
`ollama` clients send from OLLAMA_API_KEY).

/api/pull fetches into the model store's cache (models/model_store.py) only when the server was
started with --allow-pull; this server serves the one model it was started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from roseinfer.engine.async_llm import NewRequest
from roseinfer.errors import InvalidRequestError, ModelLoadError
from roseinfer.outputs import TokenLogprob
from roseinfer.reasoning import ReasoningDelta
from roseinfer.server.api_family import ApiContext, ApiError, unless_disconnected
from roseinfer.server.completions_serving import CompletionServing
from roseinfer.server.embeddings_api import embed_inputs
from roseinfer.server.error_responses import error_event, generation_failure
from roseinfer.server.ignored_fields import log_ignored
from roseinfer.server.image_parts import in_request_terms
from roseinfer.server.middleware import ErrorReshape, error_message_of
from roseinfer.server.ollama_protocol import (
    ChatBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    PullBody,
    ShowBody,
    format_fields,
    openai_messages,
    sampling_fields,
)
from roseinfer.server.openapi import _ERRORS, _RETRY_AFTER, finish_document
from roseinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from roseinfer.server.serving import OpenAIServing, Submitted, log_stream_failure
from roseinfer.tool_parsers import ContentDelta, ToolCallDelta

logger = logging.getLogger("roseinfer.server")

PATH_PREFIX = "/api/"
OLLAMA_VERSION = "0.12.0"  # the version of Ollama's API these routes follow (clients check a minimum)
STARTED = datetime.now(UTC)


class OllamaError(BaseModel):
    """Every error on the Ollama routes (and the last line of a stream that failed)."""

    error: str


_OLLAMA_ERRORS = _ERRORS | {403: "Pulling is off on this server (start it with --allow-pull)."}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses, in Ollama's error shape."""
    return {status: {"model": OllamaError, "description": _OLLAMA_ERRORS[status]}
            | ({"headers": _RETRY_AFTER} if status == 503 else {}) for status in statuses}


def _streamed(what: str) -> dict[int | str, dict[str, Any]]:
    """The 200 response of a route that answers one JSON object, or (stream: true, the default)
    NDJSON: one object per line."""
    return {200: {"description": f"{what}: with `stream: true` (the default) NDJSON, one object per line, the "
                                 "last one `done: true` (or an {\"error\"} line); with `stream: false` the whole "
                                 "response as one object",
                  "content": {"application/json": {"schema": {"type": "object"}},
                              "application/x-ndjson": {"schema": {"type": "object"}}}}}


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _reshaped(status: int, body: bytes) -> bytes:
    return json.dumps({"error": error_message_of(status, body)}, ensure_ascii=False).encode()


def _ndjson(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False) + "\n"


class ModelFacts:
    """What Ollama's /api/tags, /api/show and /api/ps tell of the served model, read once from its
    files (no weight is read)."""

    def __init__(self, engine: Any, name: str) -> None:
        source = engine.model_source
        config = engine.model_config
        self.name = name
        self.path: Path = source.path
        files = [self.path] if self.path.is_file() else [p for p in self.path.rglob("*") if p.is_file()]
        self.size = 0
        self.metadata: dict[str, Any] = {}
        self.parameters = 0
        self.quant = ""
        if source.kind == "gguf":
            gguf = source.gguf()
            files = list(getattr(gguf, "shard_paths", None) or [self.path])
            self.metadata = {k: v for k, v in gguf.metadata.items() if not k.startswith("tokenizer.")}
            types: dict[str, int] = {}
            for tensor in gguf.tensor_names():
                count = 1
                for dim in gguf.tensor_shape(tensor):
                    count *= dim
                self.parameters += count
                if len(gguf.tensor_shape(tensor)) == 2:
                    kind = gguf.tensor_type(tensor).name
                    types[kind] = types.get(kind, 0) + count
            from roseinfer.models.model_store import quant_of

            self.quant = quant_of(self.path.name) or (max(types, key=types.get) if types else "")
            self.format, self.family = "gguf", gguf.architecture
        else:
            self.format, self.family = "safetensors", config.architecture
        self.size = sum(p.stat().st_size for p in files)
        # A file in the Hub cache is named by its sha256 (what Ollama's digest is); otherwise an id
        # of its path, size and time (hashing gigabytes at startup is not worth it).
        blob = self.path.resolve().name if self.path.is_file() else ""
        self.digest = blob if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob) else hashlib.sha256(
            f"{self.path.resolve()}:{self.size}:{self.path.stat().st_mtime_ns}".encode()).hexdigest()
        self.context_length = engine.max_model_len
        self.modified_at = datetime.fromtimestamp(self.path.stat().st_mtime, UTC).isoformat().replace("+00:00", "Z")

    def details(self) -> dict[str, Any]:
        size = self.parameters
        parameter_size = f"{size / 1e9:.1f}B" if size >= 1e9 else f"{size / 1e6:.0f}M" if size else ""
        return {"parent_model": "", "format": self.format, "family": self.family, "families": [self.family],
                "parameter_size": parameter_size, "quantization_level": self.quant}

    def tag(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details()}


def _logprobs(serving: OpenAIServing, entries: list[TokenLogprob] | None) -> list[dict[str, Any]] | None:
    if not entries:
        return None
    result = []
    for entry in entries:
        token = serving.token_text(entry.token_id)
        result.append({"token": token, "logprob": entry.logprob, "bytes": list(token.encode()),
                       "top_logprobs": [{"token": (t := serving.token_text(i)), "logprob": lp,
                                         "bytes": list(t.encode())} for i, lp in entry.top]})
    return result


@contextlib.contextmanager
def images_named(places: dict[str, str]) -> Iterator[None]:
    """An error about an image names it by its place in the Ollama request (messages[i].images[j],
    or a generate's images[j]), not by the image_url part it became."""
    try:
        yield
    except InvalidRequestError as exc:
        renamed = in_request_terms(exc, places)
        if renamed is exc:
            raise
        raise renamed from exc


def _tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Our calls (JSON-text arguments) in Ollama's shape (an arguments object)."""
    result = []
    for index, call in enumerate(calls):
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except ValueError:
            arguments = call.arguments
        result.append({"id": call.id, "function": {"index": index, "name": call.name, "arguments": arguments}})
    return result


class _Call:
    def __init__(self, id_: str | None, name: str | None) -> None:
        self.id, self.name, self.arguments = id_, name, ""


def register(app: FastAPI, context: ApiContext) -> None:
    serving = context.serving
    engine = serving.engine
    completion = CompletionServing(serving)
    router = APIRouter(tags=["Ollama"])
    facts: list[ModelFacts] = []

    def model_facts() -> ModelFacts:
        if not facts:
            facts.append(ModelFacts(engine, context.model_name))
        return facts[0]

    def check_model(name: str | None) -> None:
        """Ollama's spellings of the served model: its name, NAME:latest, hf.co/NAME."""
        if name is None:
            return
        bare = name.removeprefix("hf.co/").removesuffix(":latest")
        served = context.model_name.removesuffix(":latest")
        if bare != served:
            raise ApiError(404, f"model '{name}' not found; this server serves '{context.model_name}'", "model",
                           "model_not_found")

    def think_fields(think: bool | str | None) -> dict[str, Any]:
        if think is None:
            return {}
        if serving.reasoning_parser is None:
            if think is False:
                return {}
            raise InvalidRequestError(f'"{context.model_name}" does not support thinking (start the server with '
                                      "--reasoning-parser for a thinking model)", "think")
        if think is True:
            return {}
        if think is False:
            return {"chat_template_kwargs": {"enable_thinking": False}}
        if think not in ("low", "medium", "high"):
            raise InvalidRequestError(f'think must be true, false, "low", "medium" or "high", got {think!r}', "think")
        return {"reasoning_effort": think}

    async def fit_context(requests: list[NewRequest], num_ctx: int | None) -> None:
        """A request's num_ctx below the server's context: its prompt and output must fit it."""
        if num_ctx is None:
            return
        for request in requests:
            _, ids = await asyncio.get_running_loop().run_in_executor(
                None, engine.input_processor.tokenize, request.prompt)
            if len(ids) >= num_ctx:
                raise InvalidRequestError(f"the prompt has {len(ids)} tokens, which leaves no room within "
                                          f"options.num_ctx {num_ctx}", "options.num_ctx")
            room = num_ctx - len(ids)
            params = request.params
            params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)

    def chat_body(body: ChatBody | GenerateBody, messages: list[dict[str, Any]], request: Request) -> tuple[
            ChatCompletionRequest, int | None]:
        fields, num_ctx, ignored = sampling_fields(body.options, engine.max_model_len)
        if body.keep_alive is not None:
            ignored["keep_alive"] = "this server keeps its one model loaded"
        log_ignored(request, ignored)
        try:
            chat = ChatCompletionRequest.model_validate({
                "model": None, "messages": messages, "stream": body.stream, **fields, **format_fields(body.format),
                **think_fields(body.think),
                **({"tools": body.tools} if getattr(body, "tools", None) else {}),
                **({"logprobs": True, "top_logprobs": body.top_logprobs or 0} if body.logprobs else {}),
            })
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise InvalidRequestError(f"{where}: {first.get('msg')}", where or None) from None
        return chat, num_ctx

    def base(started: float, submitted: Submitted) -> dict[str, Any]:
        prompt = sum(submitted.prompt_tokens.values())
        total = int((time.monotonic() - started) * 1e9)
        return {"total_duration": total, "load_duration": 0, "prompt_eval_count": prompt,
                "prompt_eval_duration": 0, "eval_count": submitted.completion_tokens, "eval_duration": total}

    async def chat_outputs(submitted: Submitted, chat: ChatCompletionRequest, started: float,
                           generate: bool) -> AsyncIterator[dict[str, Any]]:
        """Ollama's chunks for a chat (or templated generate) request: each step's text, the
        thinking apart, tool calls whole once they are complete, then the final chunk."""
        reasoning = None  # the thinking model's splitter, made for the prompt its first output names
        tools = submitted.tool_calling.stream() if submitted.tool_calling is not None else None
        calls: dict[int, _Call] = {}
        async for output in serving.outputs(submitted):
            (piece,) = output.outputs
            if piece.error is not None:
                raise generation_failure(piece)
            if reasoning is None and serving.reasoning_parser is not None:
                reasoning = serving.reasoning_parser.stream(output.prompt)
            thinking, answer = "", piece.text
            if reasoning is not None:
                split = reasoning.feed(piece.text)
                if piece.finished:
                    tail = reasoning.finish()
                    split = ReasoningDelta(split.reasoning + tail.reasoning, split.content + tail.content)
                thinking, answer = split.reasoning, split.content
            content = answer
            if tools is not None:
                content = ""
                for delta in tools.feed(answer) + (tools.finish() if piece.finished else []):
                    if isinstance(delta, ContentDelta):
                        content += delta.text
                    elif isinstance(delta, ToolCallDelta):
                        call = calls.setdefault(delta.index, _Call(delta.id, delta.name))
                        call.arguments += delta.arguments
            logprobs = _logprobs(serving, piece.logprobs) if chat.logprobs else None
            if content or thinking or logprobs:
                yield chunk(generate, content, thinking, None, logprobs)
            if piece.finished:
                if calls:
                    yield chunk(generate, "", "", _tool_calls([calls[i] for i in sorted(calls)]), None)
                reason = "length" if piece.finish_reason == "length" else "stop"
                final = chunk(generate, "", "", None, None) | {"done": True, "done_reason": reason}
                yield final | base(started, submitted)
        submitted.log()

    def chunk(generate: bool, content: str, thinking: str, tool_calls: list | None,
              logprobs: list | None) -> dict[str, Any]:
        value: dict[str, Any] = {"model": context.model_name, "created_at": _now()}
        if generate:
            value["response"] = content
            if thinking:
                value["thinking"] = thinking
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            value["message"] = message
        if logprobs:
            value["logprobs"] = logprobs
        value["done"] = False
        return value

    async def raw_outputs(submitted: Submitted, logprobs: bool, started: float) -> AsyncIterator[dict[str, Any]]:
        async for output in serving.outputs(submitted):
            (piece,) = output.outputs
            if piece.error is not None:
                raise generation_failure(piece)
            entries = _logprobs(serving, piece.logprobs) if logprobs else None
            if piece.text or entries:
                yield chunk(True, piece.text, "", None, entries)
            if piece.finished:
                reason = "length" if piece.finish_reason == "length" else "stop"
                yield chunk(True, "", "", None, None) | {"done": True, "done_reason": reason} | base(started, submitted)
        submitted.log()

    async def whole(chunks: AsyncIterator[dict[str, Any]], generate: bool) -> dict[str, Any]:
        """The stream's chunks as one response (stream: false)."""
        content, thinking, tool_calls, logprobs = [], [], [], []
        final: dict[str, Any] = {}
        async for value in chunks:
            part = value if generate else value["message"]
            content.append(part.get("response" if generate else "content", ""))
            thinking.append(part.get("thinking", ""))
            tool_calls += part.get("tool_calls", [])
            logprobs += value.get("logprobs") or []
            final = value
        if generate:
            final["response"] = "".join(content)
            if any(thinking):
                final["thinking"] = "".join(thinking)
        else:
            final["message"] = {"role": "assistant", "content": "".join(content)}
            if any(thinking):
                final["message"]["thinking"] = "".join(thinking)
            if tool_calls:
                final["message"]["tool_calls"] = tool_calls
        if logprobs:
            final["logprobs"] = logprobs
        return final

    async def ndjson(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        try:
            async for value in chunks:
                yield _ndjson(value)
        except Exception as exc:  # after the response started: a last line says why
            log_stream_failure(exc)
            yield _ndjson({"error": error_event(exc)["error"]["message"]})

    async def respond(request: Request, chunks: AsyncIterator[dict[str, Any]], stream: bool,
                      generate: bool) -> Response:
        if stream:
            return StreamingResponse(ndjson(chunks), media_type="application/x-ndjson")
        return await unless_disconnected(request, whole(chunks, generate))

    def loaded(generate: bool) -> JSONResponse:
        """An empty request only loads the model (Ollama's way to preload one): done at once."""
        value = chunk(generate, "", "", None, None) | {"done": True, "done_reason": "load"}
        return JSONResponse(value)

    @router.post("/api/chat", responses=_streamed("The answer") | _errors(400, 401, 404, 408, 413, 500, 503))
    async def api_chat(body: ChatBody, request: Request) -> Response:
        check_model(body.model)
        started = time.monotonic()
        if not body.messages:
            return loaded(False)
        messages, places = openai_messages(body.messages, serving.takes_images)
        chat, num_ctx = chat_body(body, messages, request)
        with images_named(places):
            requests, tool_calling = serving.chat_requests(chat)
            for engine_request in requests:  # num_predict is an upper bound, as in Ollama
                engine_request.fit_max_tokens = True
            await fit_context(requests, num_ctx)
            submitted = await serving.submit("/api/chat", "chatcmpl", requests, 1, tool_calling)
        return await respond(request, chat_outputs(submitted, chat, started, False), body.stream, False)

    @router.post("/api/generate", responses=_streamed("The answer") | _errors(400, 401, 404, 408, 413, 500, 503))
    async def api_generate(body: GenerateBody, request: Request) -> Response:
        check_model(body.model)
        started = time.monotonic()
        for name, why in (("suffix", "fill-in-the-middle is not supported"),
                          ("template", "a per-request template is not supported; the model's own is used"),
                          ("context", "a previous response's context is not supported; use /api/chat")):
            if getattr(body, name):
                raise InvalidRequestError(f"{name}: {why}", name)
        if not body.prompt:
            return loaded(True)
        if body.raw:  # the prompt as it is, as /v1/completions takes it
            if body.system or body.images or body.think not in (None, False):
                raise InvalidRequestError("raw: the prompt is sent as it is, so system, images and think cannot "
                                          "apply", "raw")
            fields, num_ctx, ignored = sampling_fields(body.options, engine.max_model_len)
            log_ignored(request, ignored | ({"keep_alive": "this server keeps its one model loaded"}
                                            if body.keep_alive is not None else {}))
            try:
                raw = CompletionRequest.model_validate({
                    "prompt": body.prompt, "stream": body.stream, **fields, **format_fields(body.format),
                    **({"logprobs": body.top_logprobs or 0} if body.logprobs else {})})
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first.get("loc", ()))
                raise InvalidRequestError(f"{where}: {first.get('msg')}", where or None) from None
            requests = completion.requests(raw)
            for engine_request in requests:
                engine_request.fit_max_tokens = True
            await fit_context(requests, num_ctx)
            submitted = await serving.submit("/api/generate", "cmpl", requests, 1)
            return await respond(request, raw_outputs(submitted, body.logprobs, started), body.stream, True)
        messages, places = openai_messages(
            ([{"role": "system", "content": body.system}] if body.system else [])
            + [{"role": "user", "content": body.prompt, "images": body.images or []}], serving.takes_images, "images")
        chat, num_ctx = chat_body(body, messages, request)
        with images_named(places):
            requests, tool_calling = serving.chat_requests(chat)
            for engine_request in requests:
                engine_request.fit_max_tokens = True
            await fit_context(requests, num_ctx)
            submitted = await serving.submit("/api/generate", "cmpl", requests, 1, tool_calling)
        return await respond(request, chat_outputs(submitted, chat, started, True), body.stream, True)

    @router.post("/api/embed", responses=_errors(400, 401, 404, 408, 413, 500, 503))
    async def api_embed(body: EmbedBody, request: Request) -> Response:
        check_model(body.model)
        started = time.monotonic()
        _, _, ignored = sampling_fields(body.options, engine.max_model_len)  # an unknown option is still an error
        # truncate (true by default): an input longer than the context is an error here, never cut.
        log_ignored(request, ignored)
        inputs = [body.input] if isinstance(body.input, str) else list(body.input)
        vectors, tokens = await embed_inputs(engine, inputs, None, body.dimensions)
        return JSONResponse({"model": context.model_name, "embeddings": [v.tolist() for v in vectors],
                             "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
                             "prompt_eval_count": tokens})

    @router.post("/api/embeddings", responses=_errors(400, 401, 404, 408, 413, 500, 503))
    async def api_embeddings(body: EmbeddingsBody, request: Request) -> Response:
        """Ollama's older one-prompt route (superseded by /api/embed): {"embedding": [...]}."""
        check_model(body.model)
        _, _, ignored = sampling_fields(body.options, engine.max_model_len)
        log_ignored(request, ignored)
        vectors, _ = await embed_inputs(engine, [body.prompt])
        return JSONResponse({"embedding": vectors[0].tolist()})

    @router.get("/api/tags", responses=_errors(401))
    async def api_tags() -> dict[str, Any]:
        return {"models": [model_facts().tag()]}

    @router.get("/api/ps", responses=_errors(401))
    async def api_ps() -> dict[str, Any]:
        facts_ = model_facts()
        never = "2318-01-01T00:00:00Z"  # loaded for as long as the server runs (Ollama's "forever")
        return {"models": [facts_.tag() | {"expires_at": never, "size_vram": 0 if engine.config.torch_device.type == "cpu"
                                           else facts_.size, "context_length": facts_.context_length}]}

    @router.post("/api/show", responses=_errors(400, 401, 404, 413))
    async def api_show(body: ShowBody) -> dict[str, Any]:
        name = body.model or body.name
        if not name:
            raise InvalidRequestError("model is required", "model")
        check_model(name)
        facts_ = model_facts()
        info = {"general.architecture": facts_.family, "general.parameter_count": facts_.parameters,
                f"{facts_.family}.context_length": facts_.context_length}
        if body.verbose:
            info |= {k: v for k, v in facts_.metadata.items() if not isinstance(v, (list, bytes))}
        capabilities = ["completion", "embedding"]
        if serving.tool_call_parser is not None:
            capabilities.append("tools")
        if serving.reasoning_parser is not None:
            capabilities.append("thinking")
        template = getattr(serving.tokenizer, "chat_template", None) or ""
        return {"license": "", "modelfile": f"# served by roseinfer\nFROM {facts_.path}\n", "parameters": "",
                "template": template, "details": facts_.details(), "model_info": info,
                "capabilities": capabilities, "modified_at": facts_.modified_at}

    @router.get("/api/version", responses=_errors(401))
    async def api_version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION}

    @router.post("/api/pull", responses=_streamed("The progress") | _errors(400, 401, 403, 413))
    async def api_pull(body: PullBody) -> Response:
        name = body.model or body.name
        if not name:
            raise InvalidRequestError("model is required", "model")
        if not context.allow_pull:
            raise ApiError(403, "pulling models is off on this server (start it with --allow-pull)", "model")
        from roseinfer.models.model_store import parse_model_ref, pull

        ref = parse_model_ref(name.removeprefix("hf.co/"))
        if ref is None:
            raise InvalidRequestError(f"{name!r} is not a Hugging Face model: name it as [hf.co/]user/repo[:QUANT]",
                                      "model")

        async def progress() -> AsyncIterator[dict[str, Any]]:
            yield {"status": "pulling manifest"}
            try:
                path = await asyncio.get_running_loop().run_in_executor(None, lambda: pull(ref, progress=False))
            except ModelLoadError as exc:  # what is not there, a failed download: the client's to fix
                raise InvalidRequestError(str(exc), "model") from exc
            size = path.stat().st_size if path.is_file() else 0
            yield {"status": "verifying sha256 digest", "total": size, "completed": size}
            yield {"status": "success"}

        if body.stream:
            return StreamingResponse(ndjson(progress()), media_type="application/x-ndjson")
        async for value in progress():
            last = value
        return JSONResponse(last)

    app.include_router(router)
    finish_document(app, extra_models=[OllamaError])
    app.add_middleware(ErrorReshape, prefix=PATH_PREFIX, reshape=_reshaped)

