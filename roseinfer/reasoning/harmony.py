"""gpt-oss's harmony format, through OpenAI's `openai-harmony` library (never written by hand here).

A harmony completion is a run of assistant messages on named channels::

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

The analysis channel is the reasoning (`reasoning_content`, Responses reasoning items, Anthropic
thinking blocks), a message addressed to `functions.NAME` is a tool call whose content is its JSON
arguments, and the final channel is the answer. `HarmonyReasoningParser` is the registry's
"harmony" reasoning parser and `HarmonyToolParser` (tool_parsers/harmony.py) its tool parser: both
read the completion's text with the special tokens kept, which they encode back to the tokens
openai-harmony's parser takes (the markup tokens are single special tokens, so the text says
exactly which were generated).

`render_prompt` renders a chat conversation (system/developer instructions, tools, earlier
reasoning, tool calls and results, reasoning_effort) as the token ids of a harmony prompt.

The library reads the o200k vocabulary through tiktoken's cache: with no network, point
`TIKTOKEN_ENCODINGS_BASE` at a directory holding `o200k_base.tiktoken`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from roseinfer.reasoning.base import Phase, ReasoningDelta, ReasoningParser, ReasoningSplit

REASONING_EFFORTS = ("low", "medium", "high")
FUNCTIONS = "functions."  # the recipient prefix of a function tool call


@functools.cache
def harmony_encoding() -> Any:
    """openai-harmony's gpt-oss encoding (loaded once; a clear error when its vocabulary cannot be
    found)."""
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as exc:
        raise RuntimeError(
            f"openai-harmony could not load the o200k vocabulary ({exc}); without network access, set "
            "TIKTOKEN_ENCODINGS_BASE to a directory holding o200k_base.tiktoken"
        ) from exc


@dataclass
class HarmonyCall:
    """A function call the model addressed to `functions.NAME`, with its JSON arguments text."""

    name: str
    arguments: str
    written: str = ""  # the arguments as the model wrote them

    def markup(self) -> str:
        """The call as one whole harmony message's text (rendered by openai-harmony)."""
        from openai_harmony import Message, Role

        encoding = harmony_encoding()
        message = (Message.from_role_and_content(Role.ASSISTANT, self.written or self.arguments)
                   .with_channel("commentary").with_recipient(FUNCTIONS + self.name)
                   .with_content_type("<|constrain|>json"))
        return encoding.decode(encoding.render(message))


@dataclass
class HarmonyParse:
    """A completion read so far: its reasoning and answer text, the calls it finished, and
    whether it is inside a call still (whose arguments are not complete)."""

    reasoning: str = ""
    content: str = ""
    calls: list[HarmonyCall] = field(default_factory=list)
    thought: bool = False
    answered: bool = False
    # The answer's text pieces and the calls, in the order the model wrote them.
    answer_parts: list[str | HarmonyCall] = field(default_factory=list)


def parse_tokens(tokens: Sequence[int], parsed: HarmonyParse | None = None, continuing: bool = True) -> HarmonyParse:
    """The messages of a completion's token ids (`continuing`: the output after the prompt's
    `<|start|>assistant`; else whole messages, each from its `<|start|>`), the unfinished last one
    included, added to `parsed`."""
    from openai_harmony import HarmonyError, Role, StreamableParser

    parser = StreamableParser(harmony_encoding(), Role.ASSISTANT if continuing else None)
    for token in tokens:
        try:
            parser.process(token)
        except HarmonyError:  # not harmony from here on: what parsed so far stands
            break
    parsed = parsed if parsed is not None else HarmonyParse()
    for message in parser.messages:
        text = "".join(getattr(part, "text", "") for part in message.content)
        _add(parsed, message.channel, message.recipient, text, done=True)
    if parser.current_content or parser.current_channel:
        _add(parsed, parser.current_channel, parser.current_recipient, parser.current_content, done=False)
    return parsed


def _add(parsed: HarmonyParse, channel: str | None, recipient: str | None, text: str, done: bool) -> None:
    if recipient and recipient.startswith(FUNCTIONS):
        if done:
            call = HarmonyCall(recipient[len(FUNCTIONS):], _arguments(text), text)
            parsed.calls.append(call)
            parsed.answer_parts.append(call)
    elif channel == "analysis":
        parsed.reasoning += text
        parsed.thought = True
    elif channel in ("final", "commentary", None):  # commentary without a recipient: a preamble
        parsed.content += text
        parsed.answered = True
        parsed.answer_parts.append(text)


def _arguments(text: str) -> str:
    """The call's JSON arguments, normalised where they parse (left as written otherwise)."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def parse_text(text: str) -> HarmonyParse:
    """As `parse_tokens`, from the completion's text with the special tokens kept. A trailing
    start of a special token (`<|chan`) is left out until it is whole."""
    return parse_tokens(harmony_encoding().encode(_whole_tokens(text), allowed_special="all"))


def _whole_tokens(text: str) -> str:
    """`text` less a trailing start of a special token (`<`, `<|chan`), held until it is whole."""
    if text.endswith("<"):
        return text[:-1]
    cut = text.rfind("<|")
    return text[:cut] if cut >= 0 and "|>" not in text[cut:] else text


def parse_messages_text(text: str) -> HarmonyParse:
    """Plain answer text followed by whole harmony messages (what the reasoning parser hands on as
    the answer when the model called tools): the text before the first `<|start|>` is content."""
    start = text.find("<|start|>")
    head, rest = (text, "") if start < 0 else (text[:start], text[start:])
    parsed = HarmonyParse(content=head, answered=bool(head), answer_parts=[head] if head else [])
    if rest:
        parse_tokens(harmony_encoding().encode(_whole_tokens(rest), allowed_special="all"), parsed, continuing=False)
    return parsed


def answer_with_calls(parsed: HarmonyParse) -> str:
    """The answer text and, after it, each finished call as its harmony message (for the tool
    parser, which reads the calls back from it)."""
    return "".join(part if isinstance(part, str) else part.markup() for part in parsed.answer_parts)


class HarmonyReasoningParser(ReasoningParser):
    """The analysis channel as the reasoning, the final channel as the answer."""

    name = "harmony"
    start_tag = "<|channel|>analysis<|message|>"
    end_tag = "<|end|>"
    unopened_phase = Phase.UNDECIDED
    token_tags = False
    keeps_special_tokens = True

    def split(self, text: str, prompt: str | None = None) -> ReasoningSplit:
        parsed = parse_text(text)
        answered = parsed.answered or bool(parsed.calls) or not parsed.thought
        return ReasoningSplit(parsed.reasoning if parsed.thought else None,
                              answer_with_calls(parsed) if answered else None)

    def stream(self, prompt: str | None = None) -> HarmonyReasoningStream:
        return HarmonyReasoningStream()


class HarmonyReasoningStream:
    """Re-reads the whole text at each piece (a completion's messages are short next to the
    model's step) and sends what each part grew by."""

    def __init__(self) -> None:
        self._text = ""
        self._sent = HarmonyParse()
        self._answer = ""
        self.phase = Phase.UNDECIDED
        self.thought = False

    def feed(self, text: str) -> ReasoningDelta:
        self._text += text
        return self._delta(parse_text(self._text))

    def finish(self) -> ReasoningDelta:
        return self._delta(parse_tokens(harmony_encoding().encode(self._text, allowed_special="all")))

    def _delta(self, parsed: HarmonyParse) -> ReasoningDelta:
        answer = answer_with_calls(parsed)
        delta = ReasoningDelta(parsed.reasoning[len(self._sent.reasoning):], answer[len(self._answer):])
        self._sent, self._answer = parsed, answer
        self.thought = parsed.thought
        if parsed.answered or parsed.calls:
            self.phase = Phase.ANSWERING
        elif parsed.thought:
            self.phase = Phase.THINKING
        return delta


def render_prompt(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
) -> list[int]:
    """OpenAI chat messages (and function tools) as a harmony prompt's token ids, ending with the
    assistant's `<|start|>assistant` for the model to continue. System and developer messages
    become the developer instructions; `reasoning_effort` (low, medium, high) the system
    message's reasoning level."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new()
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}")
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    rendered = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools([
                ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                    parameters=t["function"].get("parameters"))
                for t in tools
            ])
        rendered.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for the tool results
    for message in messages:
        role = message.get("role")
        if role == "user":
            rendered.append(Message.from_role_and_content(Role.USER, _text(message.get("content"))))
        elif role == "assistant":
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if reasoning:
                rendered.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            for call in message.get("tool_calls") or []:
                function = call["function"]
                call_names[call.get("id", "")] = function["name"]
                arguments = function.get("arguments") or "{}"
                if not isinstance(arguments, str):  # an object (Anthropic's tool_use input): its JSON
                    arguments = json.dumps(arguments, ensure_ascii=False)
                rendered.append(
                    Message.from_role_and_content(Role.ASSISTANT, arguments)
                    .with_channel("commentary").with_recipient(FUNCTIONS + function["name"])
                    .with_content_type("<|constrain|>json")
                )
            if _text(message.get("content")):
                rendered.append(Message.from_role_and_content(Role.ASSISTANT, _text(message["content"]))
                                .with_channel("final"))
        elif role == "tool":
            name = message.get("name") or call_names.get(message.get("tool_call_id", ""), "")
            rendered.append(
                Message.from_author_and_content(Author.new(Role.TOOL, FUNCTIONS + name), _text(message.get("content")))
                .with_channel("commentary").with_recipient("assistant")
            )
        elif role not in ("system", "developer"):
            raise ValueError(f"message role {role!r} has no harmony rendering")
    conversation = Conversation.from_messages(rendered)
    return list(harmony_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT))


def _text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))
