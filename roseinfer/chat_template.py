"""Rendering a model's own jinja chat template, sandboxed, with the same output as transformers.

Chat templates ship with model files, so they are untrusted code: they run in jinja's immutable
sandbox, which refuses `__class__`-style attribute access and mutating the inputs.

Conversations as agents send them (a system message in the middle, a developer message, two user
turns in a row) are rendered as sent where the template takes them; where it refuses them (Gemma's
and Mistral's "roles must alternate", "system message must be at the beginning"), they are placed
as it allows (`conformed_messages`): the leading system messages merged into one, later ones
turned into user turns where they stand (so an agent's earlier turns keep their prefix), and
consecutive turns of one role merged; if the template takes no system role at all, the system
text opens the first user turn.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    /,
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """`template` rendered for `messages`; template problems and bad messages raise ValueError.
    Both are positional-only, so no name in `extra` (a caller's chat_template_kwargs) collides."""
    if not isinstance(template, str):
        raise ValueError(f"a chat template must be a string, got {type(template).__name__}")
    compiled = _compile(template)
    variables: dict[str, Any] = {
        "messages": normalize_messages(messages, keep_parts=_reads_content_parts(template)),
        "add_generation_prompt": add_generation_prompt,
        # Templates test `tools is not none`; an undefined name would pass that test.
        "tools": None,
        "documents": None,
    }
    # A missing special token stays undefined (renders as ""), never the string "None".
    variables.update((k, v) for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None)
    variables.update(extra)
    if "developer" not in template:  # a template that does not know the role reads it as system
        variables["messages"] = [{**m, "role": "system"} if m["role"] == "developer" else m
                                 for m in variables["messages"]]
    try:
        return _render(compiled, variables)
    except ValueError as refused:
        for placed in (conformed_messages(variables["messages"]),
                       conformed_messages(variables["messages"], system_role=False)):
            if placed == variables["messages"]:
                continue
            try:
                return _render(compiled, {**variables, "messages": placed})
            except ValueError:
                pass
        raise refused from None


def _render(compiled: jinja2.Template, variables: dict[str, Any]) -> str:
    try:
        return compiled.render(variables)
    except ValueError:  # raise_exception() in the template, already a clear message
        raise
    except SecurityError as exc:
        raise ValueError(f"chat template tried an operation the sandbox forbids: {exc}") from exc
    except Exception as exc:  # the template's own bugs: undefined names, type errors, ...
        raise ValueError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc


def conformed_messages(messages: list[dict[str, Any]], *, system_role: bool = True) -> list[dict[str, Any]]:
    """The conversation in the shape strict templates take: one system message first (or, without
    `system_role`, its text at the start of the first user turn), system and developer messages
    after the first other turn as user turns where they stand, and consecutive user (or assistant)
    turns merged into one."""
    leading: list[str] = []
    rest: list[dict[str, Any]] = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        if role == "system" and not rest:
            leading.append(_text(message))
        elif role == "system":
            rest.append({"role": "user", "content": _text(message)})
        else:
            rest.append(dict(message))
    merged: list[dict[str, Any]] = []
    for message in rest:
        previous = merged[-1] if merged else None
        if previous is not None and message["role"] == previous["role"] and message["role"] in ("user", "assistant"):
            merged[-1] = _merged(previous, message)
        else:
            merged.append(message)
    if not leading:
        return merged
    system = "\n\n".join(leading)
    if system_role:
        return [{"role": "system", "content": system}, *merged]
    first_user = next((i for i, m in enumerate(merged) if m["role"] == "user"), None)
    if first_user is None:
        return [{"role": "user", "content": system}, *merged]
    merged[first_user] = {**merged[first_user], "content": f"{system}\n\n{_text(merged[first_user])}"}
    return merged


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _merged(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two turns of one role as one: their texts joined, an assistant's tool calls kept in order."""
    merged = {**first, **second}
    texts = [text for text in (_text(first), _text(second)) if text]
    merged["content"] = "\n\n".join(texts)
    calls = [*first.get("tool_calls", []), *second.get("tool_calls", [])]
    if calls:
        merged["tool_calls"] = calls
    return merged


def normalize_messages(messages: Any, *, keep_parts: bool = False) -> list[dict[str, Any]]:
    """Checked copies of the messages. List-of-parts content (text parts only) is joined into one
    string, unless `keep_parts`: then the template gets the parts themselves, as transformers
    passes them (for templates that loop over a message's parts, e.g. Gemma 3's)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}] needs a 'role' string (e.g. 'user')")
        # Like transformers: keys set to None are dropped, templates handle a missing key better.
        copy = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if isinstance(content, list):
            texts = _text_parts(content, index)
            if not keep_parts and len(texts) < len(content):
                raise ValueError(f"messages[{index}] holds an image, but this model's chat template does not "
                                 "read a message's parts, so it cannot place it")
            copy["content"] = [dict(part) for part in content] if keep_parts else "\n".join(texts)
        elif content is None:
            # An assistant turn that only calls tools has no content; anything else needs some.
            if not message.get("tool_calls"):
                raise ValueError(f"messages[{index}] ({role}) needs a 'content' string")
        elif not isinstance(content, str):
            raise ValueError(
                f"messages[{index}]['content'] must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        normalized.append(copy)
    return normalized


def _text_parts(parts: list[Any], index: int) -> list[str]:
    texts = []
    for part in parts:
        if part == {"type": "image"}:  # an image's place (its pixels went to the input processor)
            continue
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"messages[{index}]['content'] has a part of type {kind!r}; only "
                "{'type': 'text', 'text': ...} parts are supported"
            )
        texts.append(part["text"])
    return texts


# -- the jinja environment ------------------------------------------------------------------------


def _raise_exception(message: Any) -> None:
    # Templates call this to reject a conversation (e.g. roles not alternating).
    raise ValueError(f"chat template error: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes <, >, & and ' — wrong for prompts, and not what models saw.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _reads_content_parts(template: str) -> bool:
    """Whether the template loops over a message's content (`for x in m['content']` or
    `m.content`): such templates render list content themselves, and a string joined from the
    parts would render differently (vLLM's "openai" content format). Others get the parts
    joined, where transformers would print the list's repr."""
    try:
        tree = _environment().parse(template)
    except TemplateSyntaxError:
        return False  # _compile reports it
    for loop in tree.find_all(nodes.For):
        target = loop.iter
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const) and target.arg.value == "content":
            return True
    return False


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat template has a syntax error (line {exc.lineno}): {exc.message}") from exc
    except TemplateError as exc:
        raise ValueError(f"chat template cannot be compiled: {exc}") from exc
