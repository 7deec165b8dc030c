"""Reasoning parsers: the thinking of a model kept apart from its answer, chosen by name
(`--reasoning-parser`, vLLM's names). One file per parser; `REASONING_PARSERS` lists them.

For an API front end::

    parser = engine.reasoning_parser                     # None: the server has none
    split = parser.split(text, prompt)                   # .reasoning, .content (None if absent)
    stream = parser.stream(prompt)                       # per streamed response
    delta = stream.feed(piece)                           # .reasoning, .content ("" if nothing)
    delta = stream.finish()                              # what was held back, at the end

`prompt` is the request's prompt text (`RequestOutput.prompt`): its end says whether the output
starts inside the thinking.
"""

from __future__ import annotations

from roseinfer.errors import InvalidRequestError
from roseinfer.reasoning.base import (
    Phase,
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
)
from roseinfer.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from roseinfer.reasoning.harmony import HarmonyReasoningParser
from roseinfer.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, HarmonyReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered under `name` (see REASONING_PARSERS)."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise InvalidRequestError(
            f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, got {name!r}", "reasoning_parser"
        ) from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "HarmonyReasoningParser",
    "Phase",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "get_reasoning_parser",
]
