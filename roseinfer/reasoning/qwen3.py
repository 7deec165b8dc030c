"""Qwen3's thinking: `<think> ... </think>` before the answer.

The hybrid Qwen3 models open `<think>` themselves as their first token (their template leaves the
assistant turn empty) and skip it when the template closed an empty one (`enable_thinking: false`);
the thinking-only models (Qwen3-*-Thinking-2507, QwQ) have it opened by the template. A response
that starts with anything but `<think>`, to a prompt that did not open one, is all answer.
"""

from __future__ import annotations

from roseinfer.reasoning.base import Phase, ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    unopened_phase = Phase.UNDECIDED
