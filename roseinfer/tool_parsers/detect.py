"""Which tool-call format a chat template writes, as llama-server's --jinja and Ollama read it: the
template's own markup for a call (its examples, or how it renders an assistant's earlier calls).

Each registered parser names its markers (`template_markers`); formats this server knows by sight
but has no parser for yet are listed here, so that their templates are not mistaken for a simpler
format that shares a marker (GLM's <tool_call> holds <arg_key> pairs, not Hermes JSON). The match
with the most markers wins.
"""

from __future__ import annotations

from roseinfer.tool_parsers.base import ToolParser

# Formats recognised without a parser here (name -> marker groups). A parser registered under the
# same name (gpt-oss's harmony, say) takes the entry over.
KNOWN_WITHOUT_PARSER: dict[str, tuple[tuple[str, ...], ...]] = {
    "glm45": (("<tool_call>", "<arg_key>"),),
    "deepseek_v3": (("tool▁calls▁begin",),),
    "kimi_k2": (("<|tool_calls_section_begin|>",),),
    "functionary": (("<function=", "<|python_tag|>"),),
    "seed_oss": (("<seed:tool_call>",),),
    "lfm2": (("<|tool_call_start|>",),),
    "minimax": (("<minimax:tool_call>",), ("<tool_call>", "<invoke")),
    "gemma4": (("<|tool_call>call:",),),
    "granite": (("<|tool_call|>",),),
}


def detect_tool_format(template: str | None, parsers: dict[str, type[ToolParser]]) -> str | None:
    """The name of the format `template` writes tool calls in (a key of `parsers`, or of
    KNOWN_WITHOUT_PARSER), or None when it has no tool-call markup."""
    if not template:
        return None
    candidates = {**KNOWN_WITHOUT_PARSER, **{name: parser.template_markers for name, parser in parsers.items()}}
    best, best_size = None, 0
    for name, groups in candidates.items():
        for group in groups:
            if len(group) > best_size and all(marker in template for marker in group):
                best, best_size = name, len(group)
    return best
