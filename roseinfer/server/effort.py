"""How hard a thinking model thinks, as each API says it: OpenAI's `reasoning.effort` (Responses) and
`reasoning_effort` (chat), Anthropic's `output_config.effort` with adaptive thinking. With a reasoning
parser an effort becomes the chat request's fields: no thinking (the template's
enable_thinking=false, which hybrid templates such as Qwen3's read), or a thinking budget (the
thinking is closed after that many tokens), or no bound at all. Without one nothing thinks, and the
routes log the effort as ignored.
"""

from __future__ import annotations

from typing import Any, Literal

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

# Thinking tokens per level: sized for the small local models this server runs, whose useful
# thinking is hundreds to a few thousand tokens; "high" and above leave it to max_tokens alone.
EFFORT_BUDGETS: dict[str, int | None] = {"low": 512, "medium": 2048, "high": None, "xhigh": None, "max": None}


def effort_fields(effort: Effort | None) -> dict[str, Any]:
    """The chat request's fields for `effort` (None: the model's default)."""
    if effort is None:
        return {}
    if effort in ("none", "minimal"):
        return {"chat_template_kwargs": {"enable_thinking": False}}
    budget = EFFORT_BUDGETS[effort]
    return {} if budget is None else {"thinking_token_budget": budget}


def effort_of_budget(budget: int) -> Effort:
    """The least effort whose budget holds `budget` thinking tokens, for a model whose thinking
    cannot be closed after a count of tokens (harmony's: its reasoning level is set instead)."""
    for effort, limit in EFFORT_BUDGETS.items():
        if limit is None or budget <= limit:
            return effort  # type: ignore[return-value]
    return "high"
