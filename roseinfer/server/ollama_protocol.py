"""Ollama's API as requests: the bodies of /api/chat, /api/generate, /api/embed, /api/show and
/api/pull, and Ollama's `options` mapped to ours, with no option silently ignored: each one either
changes the request, is refused (400 naming it), or does not change the answer here and is logged
as ignored (load-time settings such as num_gpu or num_thread).

Sampling defaults are Ollama's own (temperature 0.8, top_k 40, top_p 0.9), so that a client written
for Ollama gets what it expects; repeat_penalty applies only when sent (Ollama's 1.1 over the last
64 tokens has no equal here: our repetition penalty covers the whole context, which is
repeat_last_n -1).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from roseinfer.errors import InvalidRequestError
from roseinfer.server.protocol import StrictModel

logger = logging.getLogger("roseinfer.server")

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, when a request sets none
# Options that change nothing in the answer here (how the model is loaded and run).
NO_EFFECT = {
    "num_gpu": "layer placement; the server's --device decides", "main_gpu": "the server's --device decides",
    "num_thread": "the server's threads are set at startup", "num_batch": "the scheduler's token budget decides",
    "use_mmap": "GGUF files are always memory-mapped", "use_mlock": "memory locking is not used",
    "numa": "no NUMA placement", "low_vram": "memory is planned at startup", "f16_kv": "--kv-cache-dtype decides",
    "vocab_only": "the model is always loaded whole", "embedding_only": "both routes are always served",
    "logits_all": "logprobs are asked per request", "use_mla": "no effect",
    "num_keep": "the context is never shifted here: a prompt that does not fit is an error",
    "penalize_newline": "Ollama itself no longer applies it",
}
# Options that are accepted at the value that turns them off, and refused otherwise.
NEUTRAL = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}


class OllamaModel(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _GenerationBody(OllamaModel):
    """What /api/chat and /api/generate share: the model, the output's format and options,
    streaming, thinking and logprobs."""

    model: Annotated[str, Field(min_length=1)]
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class ChatBody(_GenerationBody):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_GenerationBody):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedBody(OllamaModel):
    model: Annotated[str, Field(min_length=1)]
    input: str | Annotated[list[str], Field(min_length=1)]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None


class EmbeddingsBody(OllamaModel):
    model: Annotated[str, Field(min_length=1)]
    prompt: Annotated[str, Field(min_length=1)]
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class ShowBody(OllamaModel):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool = False


class PullBody(OllamaModel):
    model: str | None = None
    name: str | None = None
    insecure: bool = False
    stream: bool = True


def _number(options: dict[str, Any], name: str, kind: type, low: float | None = None) -> Any:
    value = options[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise InvalidRequestError(f"options.{name} must be {'an integer' if kind is int else 'a number'}, "
                                  f"got {value!r}", f"options.{name}")
    if low is not None and value < low:
        raise InvalidRequestError(f"options.{name} must be >= {low:g}, got {value}", f"options.{name}")
    return kind(value)


def sampling_fields(options: dict[str, Any] | None, max_model_len: int) -> tuple[dict[str, Any], int | None, dict]:
    """Ollama's options as the OpenAI request fields they mean, the request's context limit
    (num_ctx; None: the server's), and the options ignored here (name -> why)."""
    options = dict(options or {})
    fields: dict[str, Any] = dict(DEFAULTS)
    ignored = {name: NO_EFFECT[name] for name in options if name in NO_EFFECT}
    for name, neutral in NEUTRAL.items():
        if name in options and options[name] != neutral:
            raise InvalidRequestError(f"options.{name}={options[name]!r} is not supported by this server (only "
                                      f"{neutral!r}, which turns it off)", f"options.{name}")
    for name in ("mirostat_tau", "mirostat_eta"):  # only mirostat (refused above) reads them
        if name in options:
            ignored[name] = "mirostat is off"
    if "temperature" in options:
        fields["temperature"] = _number(options, "temperature", float, 0.0)
    if "top_p" in options:
        fields["top_p"] = _number(options, "top_p", float, 0.0) or 1.0  # Ollama: 0 (or 1) turns it off
    if "top_k" in options:
        top_k = _number(options, "top_k", int)
        fields["top_k"] = top_k if top_k > 0 else -1  # Ollama: 0 turns it off
    if "min_p" in options:
        fields["min_p"] = _number(options, "min_p", float, 0.0)
    if "seed" in options:
        fields["seed"] = _number(options, "seed", int)
    for ours, theirs in (("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty")):
        if theirs in options:
            fields[ours] = _number(options, theirs, float)
    repeat = _number(options, "repeat_penalty", float, 0.0) if "repeat_penalty" in options else None
    if repeat not in (None, 1.0):
        last_n = options.get("repeat_last_n", 64)  # Ollama's default window
        if last_n != -1:
            raise InvalidRequestError(
                f"options.repeat_penalty over the last {last_n} tokens (repeat_last_n) is not supported: this "
                "server's repetition penalty covers the whole context; send repeat_last_n -1 for that",
                "options.repeat_last_n")
        fields["repetition_penalty"] = repeat
    elif "repeat_last_n" in options:
        ignored["repeat_last_n"] = "no repeat_penalty is applied"
    if "stop" in options:
        stop = options["stop"]
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError("options.stop must be a list of non-empty strings", "options.stop")
        fields["stop"] = stop
    if "num_predict" in options:
        num_predict = _number(options, "num_predict", int)
        if num_predict in (-1, -2):  # until the context is full
            fields["max_tokens"] = max_model_len
        elif num_predict >= 1:
            fields["max_tokens"] = num_predict
        else:
            raise InvalidRequestError(f"options.num_predict must be a number of tokens >= 1, or -1 (until the "
                                      f"context is full), got {num_predict}", "options.num_predict")
    num_ctx = None
    if "num_ctx" in options:
        num_ctx = _number(options, "num_ctx", int, 1)
        if num_ctx >= max_model_len:  # as Ollama does beyond the model's trained context: clamped
            if num_ctx > max_model_len:
                logger.warning("options.num_ctx %d is more than this server's context of %d tokens "
                               "(--max-model-len): using %d", num_ctx, max_model_len, max_model_len)
            num_ctx = None
    known = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repeat_penalty", "repeat_last_n", "stop", "num_predict", "num_ctx", "mirostat_tau", "mirostat_eta",
             *NO_EFFECT, *NEUTRAL}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidRequestError(f"unknown option(s) {', '.join(unknown)}: not one of Ollama's options this "
                                  "server knows", f"options.{unknown[0]}")
    return fields, num_ctx, ignored


def format_fields(format_: str | dict[str, Any] | None) -> dict[str, Any]:
    """`format`: "json" (any JSON object) or a JSON schema, as structured outputs."""
    if format_ is None or format_ == "":
        return {}
    if format_ == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(format_, dict):
        return {"structured_outputs": {"json": format_}}
    raise InvalidRequestError(f'format must be "json" or a JSON schema object, got {format_!r}', "format")


def openai_messages(messages: list[dict[str, Any]], takes_images: bool,
                    image_field: str | None = None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Ollama's chat messages as OpenAI's: tool calls with JSON-text arguments and ids, a tool
    result tied to the call it answers (by tool_name), thinking as reasoning_content, a message's
    images (bare base64) as image_url parts before its text, as Ollama places them. Also each
    image's place in the chat messages -> its place in the request (`image_field`: where a
    generate request's images are, for its one user message)."""
    from roseinfer.server.image_parts import text_model_refusal

    converted: list[dict[str, Any]] = []
    places: dict[str, str] = {}
    call_ids: dict[str, str] = {}  # the last call of each function name -> its id
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequestError(f"{where} must be an object with a role", where)
        unknown = set(message) - {"role", "content", "thinking", "images", "tool_calls", "tool_name", "name"}
        if unknown:
            raise InvalidRequestError(f"{where} has unknown field(s) {', '.join(sorted(unknown))}", where)
        out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
        images = message.get("images") or []
        if images:
            named = image_field or f"{where}.images"
            if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
                raise InvalidRequestError(f"{named} must be a list of base64-encoded images", named)
            if not takes_images:
                raise text_model_refusal(f"{named}[0]", "image")
            out["content"] = [{"type": "image_url", "image_url": {"url": image}} for image in images] + [
                {"type": "text", "text": out["content"]}]
            places.update({f"messages[{position}].content[{i}]": f"{named}[{i}]" for i in range(len(images))})
        if message.get("thinking"):
            out["reasoning_content"] = message["thinking"]
        calls = message.get("tool_calls") or []
        if calls:
            out["tool_calls"] = []
            for index, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise InvalidRequestError(f"{where}.tool_calls[{index}] needs a function with a name",
                                              f"{where}.tool_calls")
                arguments = function.get("arguments") or {}
                call_id = call.get("id") or f"call_{position}_{index}"
                call_ids[function["name"]] = call_id
                out["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": function["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        if message["role"] == "tool":
            name = message.get("tool_name") or message.get("name")
            if name:
                out["name"] = name
                if name in call_ids:
                    out["tool_call_id"] = call_ids[name]
        converted.append(out)
    return converted, places
