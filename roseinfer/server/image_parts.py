"""Where an image sits in a request, in each API's own terms.

The Messages and Responses APIs reach the engine as chat messages (OpenAI's `image_url` parts),
whose indices differ from the request's (a system prompt put first, a turn split around its tool
results, a stored conversation before the input). The engine names a bad image by its place in
those chat messages; `in_request_terms` names it by its place in the request as sent. A text
model's refusal is said here too, before any conversion, in the API's own words.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roseinfer.errors import InvalidRequestError


def text_model_refusal(where: str, kind: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: this model takes no images (an {kind}; it is a text model)", where)


def chat_image_paths(messages: Sequence[Any]) -> list[str]:
    """The place of each image_url part in chat messages (dicts or the chat route's models), in order."""
    paths = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        for p, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
            if kind == "image_url":
                paths.append(f"messages[{m}].content[{p}]")
    return paths


def image_places(chat_paths: list[str], request_paths: list[str]) -> dict[str, str]:
    """Chat place -> request place. The conversions keep the images' order, and the request's
    images are the last ones (a stored conversation's come first, named as they were)."""
    return dict(zip(chat_paths[len(chat_paths) - len(request_paths):], request_paths, strict=True))


def in_request_terms(exc: InvalidRequestError, places: dict[str, str]) -> InvalidRequestError:
    """The engine's error naming the request's place of the image it is about (others unchanged)."""
    param = exc.param or ""
    for chat_place, request_place in places.items():
        if param == chat_place or param.startswith(chat_place + "."):
            message = str(exc)
            renamed = request_place + param[len(chat_place):]
            if message.startswith(param):
                message = renamed + message[len(param):]
            return type(exc)(message, renamed)
    return exc
