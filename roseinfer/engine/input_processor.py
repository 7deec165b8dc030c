"""From what a caller sends to what the engine core runs: every check, the chat template,
tokenizing, and one context-length rule, once per request.

The rule: a prompt may use the whole context (`max_model_len` tokens), and a request may generate
until the sequence is one token longer than that (the last sampled token is never fed back into the
model, so it needs no place in the context): `max_model_len - len(prompt) + 1` tokens at most.
Asking for more is an error where the caller is told what fits (the OpenAI routes,
`strict_max_tokens`) and is cut to fit otherwise (the offline API, as vLLM's does; the Messages and
Responses routes, whose caps are upper bounds, as llama-server cuts them). A request that sets no
cap gets the server's default (`RequestLimits.default_max_tokens`, --max-tokens-default), cut to
fit: never an unbounded generation.

A pooling request (an embedding, `PoolingParams`) has the same prompt checks and context rule (its
prompt may use the whole context) and generates nothing; its pooling type and normalization, left
unset, are the engine's defaults, and `dimensions` may not exceed the model's hidden size.

A request with n > 1 becomes n engine-core requests ("<id>/<index>"), each with seed + index
(wrapped to 64 bits) when a seed is given, all but the first sharing the first one's prompt blocks.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from roseinfer.chat_format import ChatFormat
from roseinfer.common.messages import EngineCoreRequest, ImageInput, ReasoningSpec
from roseinfer.config import ModelConfig
from roseinfer.errors import ContextLengthError, InvalidRequestError
from roseinfer.multimodal.media import LoadedImage, MediaPolicy, load_image
from roseinfer.multimodal.prompt_images import PromptImageProcessor, image_source, is_image_part
from roseinfer.pooling_params import PoolingParams
from roseinfer.reasoning import ReasoningParser
from roseinfer.sampling_params import SamplingParams
from roseinfer.special_token_guard import RenderedChat
from roseinfer.tokenizer import Tokenizer

_SEED_SPACE = 2**64  # seeds torch accepts: [-2**63, 2**64)
# chat_template_kwargs names a caller may not set, and why: request fields of their own, and the
# template itself (the renderer's own name for it, and vLLM's).
_RESERVED_TEMPLATE_KWARGS = {
    "messages": "it is a request field of its own",
    "add_generation_prompt": "it is a request field of its own",
    "tools": "it is a request field of its own",
    "template": "a per-request chat template is not supported",
    "chat_template": "a per-request chat template is not supported",
}
# A salt is a tenant's id or secret, not a document: this bounds what each request hashes.
MAX_CACHE_SALT_CHARS = 1024


@dataclass
class ChatPrompt:
    """Chat messages to render with the model's chat template (OpenAI's message shapes).

    Special-token strings in the messages, tools and chat_template_kwargs (`<|im_start|>system`
    typed into a message) are tokenized as text, so that no caller's text can forge the
    template's turns; only the template's own markup becomes special tokens.
    `parse_special_tokens_in_messages=True` parses them as special tokens too (what transformers
    and vLLM do), for a caller who writes such markup into messages on purpose and passes no
    one else's text in them: a per-request choice of the application that sends the request,
    not a server-wide one, so no other application on the server loses the protection.
    """

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI's function tools, for the template
    parse_special_tokens_in_messages: bool = False
    # How hard to think, for a model whose chat format renders it into the prompt (harmony's
    # reasoning level); a chat template's model gets it as a thinking budget instead (server/effort.py).
    reasoning_effort: str | None = None


PromptType = str | Sequence[int] | ChatPrompt


@dataclass
class RequestLimits:
    """What one request may ask for, checked before any tokenizing (None: no limit). The server
    sets them from its flags; offline callers are trusted and have none."""

    max_prompt_chars: int | None = None  # the prompt text (a chat: as the template renders it)
    max_stop: int | None = None  # stop strings, and stop token ids
    max_stop_chars: int | None = None  # characters in one stop string
    default_max_tokens: int | None = None  # the output cap of a request that sets none (None: the context's room)


def longest_prompt_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
    """The most characters a prompt that fits the context can have: the context times the longest
    token's text (+1 for a leading space a decoder drops). The server's default prompt limit."""
    backend = tokenizer.backend
    pieces = backend.decode_batch([[i] for i in range(backend.get_vocab_size(with_added_tokens=True))],
                                  skip_special_tokens=False)
    return max_model_len * (max(map(len, pieces), default=1) + 1)


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None  # the text, when the caller gave text (or chat messages)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # max_tokens resolved; None for a pooling request
    core_requests: list[EngineCoreRequest]  # one per sequence (n)
    arrival_time: float
    pooling_params: PoolingParams | None = None  # a pooling request's, its defaults resolved

    @property
    def params(self) -> SamplingParams | PoolingParams:
        return self.pooling_params or self.sampling_params


class InputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, model_config: ModelConfig, max_model_len: int,
        reasoning_parser: ReasoningParser | None = None, default_pooling: PoolingParams | None = None,
        prompt_images: PromptImageProcessor | None = None, media_policy: MediaPolicy | None = None,
        chat_format: ChatFormat | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # A model whose prompts its format's library renders, not the chat template (chat_format.py).
        self.chat_format = chat_format
        # A vision-language model's way from image parts to placeholder runs (None: text only),
        # and the operator's limits on images (the server's --allowed-media-domains, ...).
        self.prompt_images = prompt_images
        self.media_policy = media_policy or MediaPolicy()
        self.vocab_size = model_config.vocab_size
        self.hidden_size = model_config.hidden_size
        # What a pooling request leaves unset (the engine's --pooling, --no-normalize).
        self.default_pooling = default_pooling or PoolingParams("last", True)
        self.max_model_len = max_model_len
        eos = set(model_config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        if chat_format is not None:  # harmony's <|return|> and <|call|> end the assistant's turn
            eos.update(chat_format.stop_token_ids())
        self.eos_token_ids = sorted(eos)
        self.limits = RequestLimits()
        self.reasoning_parser = reasoning_parser
        if reasoning_parser is not None and reasoning_parser.token_tags:  # checked once, at startup
            self._thinking_tokens = (self._tag_token(reasoning_parser, reasoning_parser.start_tag),
                                     self._tag_token(reasoning_parser, reasoning_parser.end_tag))

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        *,
        add_special_tokens: bool = True,
        strict_max_tokens: bool = False,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> ProcessedRequest:
        """Check and tokenize one request; raises InvalidRequestError (ContextLengthError for
        the context rule) naming the field. `cache_salt` (vLLM's): the request shares prefix-cache
        blocks only with requests of the same salt."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        _check_cache_salt(cache_salt)
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, add_special_tokens, arrival, cache_salt)
        self._check_stop_limits(params)
        text, token_ids, images = self._checked_prompt(prompt, add_special_tokens)
        params = self._resolve_params(params, len(token_ids), strict_max_tokens)
        reasoning = self._reasoning_spec(text, token_ids)
        core_requests = self._fan_out(request_id, token_ids, params, arrival, cache_salt, reasoning, images)
        return ProcessedRequest(request_id, text, token_ids, params, core_requests, arrival)

    def _process_pooling(
        self, request_id: str, prompt: PromptType, params: PoolingParams, add_special_tokens: bool, arrival: float,
        cache_salt: str | None,
    ) -> ProcessedRequest:
        text, token_ids, images = self._checked_prompt(prompt, add_special_tokens)
        params = self.resolve_pooling(params)
        core = EngineCoreRequest(request_id, token_ids, None, self.eos_token_ids, arrival, cache_salt=cache_salt,
                                 pooling_params=params, images=images)
        return ProcessedRequest(request_id, text, token_ids, None, [core], arrival, pooling_params=params)

    def resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """The request's pooling with the engine's defaults filled in, `dimensions` checked."""
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be at most the model's hidden size ({self.hidden_size}), got {params.dimensions}",
                "dimensions",
            )
        default = self.default_pooling
        return dataclasses.replace(
            params,
            pooling_type=params.pooling_type or default.pooling_type,
            normalize=default.normalize if params.normalize is None else params.normalize,
        )

    # -- prompts --------------------------------------------------------------------------
    def render_chat(self, chat: ChatPrompt) -> str:
        """The prompt text of a conversation, from the model's chat template."""
        return self._render_chat(chat).text

    def _render_chat(self, chat: ChatPrompt) -> RenderedChat:
        """The prompt text, and where in it special-token strings that the caller typed ended up."""
        kwargs = dict(chat.chat_template_kwargs or {})
        for name, why in _RESERVED_TEMPLATE_KWARGS.items():
            if name in kwargs:
                raise InvalidRequestError(f"chat_template_kwargs must not set {name!r}; {why}", "chat_template_kwargs")
        if chat.tools:
            kwargs["tools"] = chat.tools
        try:
            return self.tokenizer.render_chat(
                _arguments_as_objects(chat.messages), chat.add_generation_prompt, kwargs,
                parse_special_tokens=chat.parse_special_tokens_in_messages,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "messages") from exc

    def _render_format(self, chat: ChatPrompt) -> list[int]:
        """The prompt's token ids from the model's chat format (harmony for gpt-oss)."""
        if chat.chat_template_kwargs:
            raise InvalidRequestError(
                f"this model's prompts are rendered by its {self.chat_format.name} format, not a chat template, "
                f"so chat_template_kwargs ({', '.join(sorted(chat.chat_template_kwargs))}) cannot apply; "
                "reasoning_effort sets how hard it thinks", "chat_template_kwargs")
        self._take_images(chat.messages)  # a text model: an image part is refused by name
        if not chat.add_generation_prompt:
            raise InvalidRequestError(
                f"this model's {self.chat_format.name} prompts always end where the assistant's turn "
                "starts; add_generation_prompt must be true", "add_generation_prompt")
        try:
            return self.chat_format.render(chat.messages, chat.tools, chat.reasoning_effort)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(f"the conversation cannot be rendered as a {self.chat_format.name} "
                                      f"prompt: {exc}", "messages") from exc

    def prompt_token_ids(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(prompt text or None, checked token ids)."""
        text, ids, _ = self._checked_prompt(prompt, add_special_tokens)
        return text, ids

    def _checked_prompt(self, prompt: PromptType, add_special_tokens: bool) -> tuple[str | None, list[int], list[ImageInput]]:
        """(prompt text or None, checked token ids, the prompt's images)."""
        text, ids, images = self._tokenize(prompt, add_special_tokens)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(ids) > self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens, more than the model's context "
                f"(max_model_len {self.max_model_len})",
                "messages" if isinstance(prompt, ChatPrompt) else "prompt",
            )
        return text, ids, images

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) with the checks that bound the work (the prompt's
        characters, token ids in the vocabulary) but not the context rule: what /tokenize and
        count_tokens report, a prompt longer than the context included: an image counts its
        placeholder tokens."""
        text, ids, _ = self._tokenize(prompt, add_special_tokens)
        return text, ids

    def _tokenize(self, prompt: PromptType, add_special_tokens: bool) -> tuple[str | None, list[int], list[ImageInput]]:
        images: list[ImageInput] = []
        if isinstance(prompt, ChatPrompt) and self.chat_format is not None:
            ids = self._render_format(prompt)
            text = self._check_prompt_chars(self.tokenizer.decode(ids, skip_special_tokens=False), "messages")
        elif isinstance(prompt, ChatPrompt):
            messages, loaded = self._take_images(prompt.messages)
            rendered = self._render_chat(dataclasses.replace(prompt, messages=messages))
            text = self._check_prompt_chars(rendered.text, "messages")
            ids = self.tokenizer.encode_chat(rendered)  # the template wrote any BOS
            if loaded:
                ids, images = self.prompt_images.splice(ids, loaded, "messages")
        elif isinstance(prompt, str):
            text = self._check_prompt_chars(prompt, "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, Sequence):
            text, ids = None, list(prompt)
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt_token_ids contains {bad[:3]}, outside the vocabulary [0, {self.vocab_size})",
                    "prompt_token_ids",
                )
        else:
            raise InvalidRequestError("a prompt (text, token ids or chat messages) is required", "prompt")
        return text, ids, images

    def _take_images(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[LoadedImage]]:
        """The messages as the chat template reads them (each image part as {"type": "image"}),
        and their images decoded, in order; a 400 naming the part for a bad image, or for any
        image when the model takes none."""
        images: list[LoadedImage] = []
        result = []
        for m, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str) and self.prompt_images is not None and self.prompt_images.content_as_parts:
                message = {**message, "content": [{"type": "text", "text": content}]}
            elif isinstance(content, list):
                parts = []
                for p, part in enumerate(content):
                    field_name = f"messages[{m}].content[{p}]"
                    if self.prompt_images is None and is_image_part(part):
                        raise InvalidRequestError(f"{field_name}: this model takes no images (an {part['type']} "
                                                  "part; it is a text model)", field_name)
                    source = image_source(part, field_name)
                    if source is None:
                        parts.append(part)
                        continue
                    limit = self.media_policy.limit_per_prompt
                    if limit is not None and len(images) >= limit:
                        raise InvalidRequestError(f"{field_name}: more than {limit} image(s) in one request "
                                                  "(--limit-mm-per-prompt)", field_name)
                    images.append(load_image(source, field_name, self.media_policy))
                    parts.append({"type": "image"})
                message = {**message, "content": parts}
            result.append(message)
        return result, images

    def _check_prompt_chars(self, text: str, param: str) -> str:
        limit = self.limits.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise InvalidRequestError(
                f"the prompt has {len(text)} characters, more than this server's limit of {limit} "
                "(--max-prompt-chars)", param,
            )
        return text

    # -- parameters -----------------------------------------------------------------------
    def _check_stop_limits(self, params: SamplingParams) -> None:
        limits = self.limits
        if limits.max_stop is not None:
            for param, values in (("stop", params.stop_strings), ("stop_token_ids", params.stop_token_ids)):
                if len(values) > limits.max_stop:
                    raise InvalidRequestError(
                        f"{param} has {len(values)} entries, more than this server's limit of "
                        f"{limits.max_stop} (--max-stop)", param,
                    )
        if limits.max_stop_chars is not None:
            longest = max(params.stop_strings, key=len, default="")
            if len(longest) > limits.max_stop_chars:
                raise InvalidRequestError(
                    f"stop has a string of {len(longest)} characters, more than this server's limit "
                    f"of {limits.max_stop_chars} (--max-stop-chars)", "stop",
                )

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate (the module's rule)."""
        return self.max_model_len - num_prompt_tokens + 1

    def _resolve_params(self, params: SamplingParams, num_prompt_tokens: int, strict: bool) -> SamplingParams:
        room = self.max_new_tokens(num_prompt_tokens)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(room, self.limits.default_max_tokens or room)
        elif max_tokens > room:
            if strict:
                raise ContextLengthError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                    f"{max_tokens} for the completion), {max_tokens - room} more than fit; at most {room} "
                    "completion tokens fit after this prompt. Please reduce the prompt or max_tokens.",
                    "max_tokens",
                )
            max_tokens = room
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} contains {bad[:3]}, outside the vocabulary [0, {self.vocab_size})", name
                )
        if params.structured_outputs is not None:
            params.structured_outputs.validate()  # llguidance's own check: a 400 naming the problem
        if params.thinking_token_budget is not None and self.reasoning_parser is not None \
                and not self.reasoning_parser.token_tags:
            raise InvalidRequestError(
                f"thinking_token_budget cannot bound the {self.reasoning_parser.name} format's thinking "
                "(its channels are not single tokens); set reasoning_effort instead", "thinking_token_budget")
        if params.thinking_token_budget is not None and self.reasoning_parser is None:
            raise InvalidRequestError(
                "thinking_token_budget needs a thinking model served with a reasoning parser "
                "(roseinfer serve --reasoning-parser qwen3|deepseek_r1)", "thinking_token_budget",
            )
        if max_tokens == params.max_tokens and params.min_tokens <= max_tokens:
            return params
        return dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))

    # -- thinking models -------------------------------------------------------------------
    def _tag_token(self, parser: ReasoningParser, tag: str) -> int:
        """The one token of a thinking tag; the engine follows the thinking by these ids."""
        ids = self.tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) != 1:
            raise InvalidRequestError(
                f"the reasoning parser {parser.name!r} needs {tag!r} to be one token of the model's "
                f"vocabulary, but this tokenizer makes {len(ids)} tokens of it: is this a {parser.name} model?",
                "reasoning_parser",
            )
        if ids[0] in self.tokenizer.skipped_ids:
            raise InvalidRequestError(
                f"the reasoning parser {parser.name!r} reads {tag!r} in the output text, but this tokenizer "
                "marks it special, so it is left out of the text", "reasoning_parser",
            )
        return ids[0]

    def _reasoning_spec(self, text: str | None, token_ids: list[int]) -> ReasoningSpec | None:
        """Where the output of a prompt starts (inside the thinking or not), by the prompt's
        end: the same rule, on the same text, as the API's reasoning split."""
        parser = self.reasoning_parser
        if parser is None or not parser.token_tags:
            return None
        if text is None:  # token ids: their last few tokens hold any tag the prompt ends with
            text = self.tokenizer.decode(token_ids[-16:], skip_special_tokens=False)
        start, end = self._thinking_tokens
        return ReasoningSpec(start, end, parser.initial_phase(text).value)

    def _fan_out(
        self, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float, cache_salt: str | None,
        reasoning: ReasoningSpec | None = None, images: list[ImageInput] | None = None,
    ) -> list[EngineCoreRequest]:
        images = images or []
        if params.n == 1:
            return [EngineCoreRequest(request_id, token_ids, params, self.eos_token_ids, arrival,
                                      cache_salt=cache_salt, reasoning=reasoning, images=images)]
        first = f"{request_id}/0"
        requests = []
        for index in range(params.n):
            child = params
            if params.seed is not None:
                seed = params.seed + index
                child = dataclasses.replace(params, seed=seed - _SEED_SPACE if seed >= _SEED_SPACE else seed)
            requests.append(EngineCoreRequest(
                f"{request_id}/{index}", token_ids, child, self.eos_token_ids, arrival,
                fork_of=first if index else None, cache_salt=cache_salt, reasoning=reasoning, images=images,
            ))
        return requests


def _check_cache_salt(cache_salt: object) -> None:
    """vLLM's rule (a non-empty string when given), and a bound on its length."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError("cache_salt must be a non-empty string when given", "cache_salt")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt has {len(cache_salt)} characters, more than the limit of {MAX_CACHE_SALT_CHARS}",
            "cache_salt",
        )


def _arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their `arguments` JSON text decoded (chat templates write the
    arguments with `tojson`, and OpenAI clients send them as text), and an empty content where
    a message has only calls (templates that know no tools read `content` of every message)."""
    result = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_decoded_call(call) for call in calls]}
            if message.get("content") is None:
                message["content"] = ""
        result.append(message)
    return result


def _decoded_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the text as it came
    return {**call, "function": {**function, "arguments": arguments}}
