"""Models whose prompts are not rendered by a jinja chat template but by their own format's library,
chosen by architecture: gpt-oss speaks harmony, rendered by OpenAI's `openai-harmony`
(reasoning/harmony.py). A format renders a conversation straight to token ids, names the reasoning
and tool parsers that read what it makes the model write, and the tokens that end the model's turn.

A new format is one class here and a line in `_FORMATS`; the input processor renders every chat
prompt of such a model through it (chat completions, Responses, Anthropic Messages, /tokenize),
and the server picks its parsers unless the operator named others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

# How hard a thinking model thinks, in the words of the APIs (server/effort.py).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatFormat(ABC):
    name: ClassVar[str]
    reasoning_parser: ClassVar[str]  # the reasoning/ and tool_parsers/ registries' names
    tool_parser: ClassVar[str]

    @abstractmethod
    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               reasoning_effort: str | None) -> list[int]:
        """OpenAI chat messages (and function tools) as the prompt's token ids, ending where the
        assistant's turn starts; ValueError for a conversation the format cannot hold."""

    @abstractmethod
    def stop_token_ids(self) -> list[int]:
        """The tokens with which the model ends its turn (generation stops there)."""


class HarmonyFormat(ChatFormat):
    """gpt-oss's harmony, through openai-harmony: the system message carries the reasoning
    effort, the developer message the instructions and the function tools."""

    name = "harmony"
    reasoning_parser = "harmony"
    tool_parser = "harmony"
    # The API's efforts as harmony's three levels: "none"/"minimal" think least, as low does
    # (gpt-oss always writes an analysis), "xhigh"/"max" as much as high.
    LEVELS: ClassVar[dict[str, str]] = {"none": "low", "minimal": "low", "low": "low", "medium": "medium",
                                        "high": "high", "xhigh": "high", "max": "high"}

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               reasoning_effort: str | None) -> list[int]:
        from roseinfer.reasoning.harmony import render_prompt

        if reasoning_effort is not None and reasoning_effort not in self.LEVELS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}")
        level = self.LEVELS[reasoning_effort] if reasoning_effort is not None else None
        return render_prompt(messages, tools, reasoning_effort=level)

    def stop_token_ids(self) -> list[int]:
        from roseinfer.reasoning.harmony import harmony_encoding

        # <|return|> (the final answer is done) and <|call|> (a tool call waits for its result).
        return list(harmony_encoding().stop_tokens_for_assistant_actions())


# Model architectures (ModelConfig.architecture) -> their format; every other model's chat
# template renders its prompts.
_FORMATS: dict[str, type[ChatFormat]] = {"gpt_oss": HarmonyFormat}


def chat_format_for(architecture: str) -> ChatFormat | None:
    """The chat format of a model architecture, or None where its chat template is used."""
    format_class = _FORMATS.get(architecture)
    return format_class() if format_class is not None else None
