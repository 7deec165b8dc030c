"""What every reasoning parser does: split a response into its thinking and its answer, whole
or as the text streams in.

A thinking model writes `<think> ... </think>` before its answer. Where the output starts depends
on the end of the prompt, which the chat template wrote:

    ... <think>            the template opened the thinking: the output starts inside it
    ... </think>           the template closed it (Qwen3's enable_thinking=false): only an answer
    anything else          the parser's own rule (`unopened_phase`): Qwen3 may open `<think>`
                           with its first token; DeepSeek-R1's output is thinking from the start

The engine core follows the same phases token by token (core/reasoning_tracker.py) to start a
request's grammar after the thinking and to enforce a thinking budget; this module is the text
side, for the API front ends.
"""

from __future__ import annotations

import enum
from abc import ABC
from dataclasses import dataclass
from typing import ClassVar


class Phase(enum.Enum):
    UNDECIDED = "undecided"  # nothing generated yet; a first `<think>` would open the thinking
    THINKING = "thinking"
    ANSWERING = "answering"


@dataclass
class ReasoningDelta:
    """What a piece of streamed text added to each part ("" where it added nothing)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass
class ReasoningSplit:
    """A whole response: `reasoning` is None when the model did not think, `content` None when
    the thinking never ended (the output was cut off inside it)."""

    reasoning: str | None
    content: str | None


class ReasoningParser(ABC):
    """One kind of thinking markup. Subclasses set the tags and `unopened_phase`."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # Where the output starts when the prompt ends with neither tag.
    unopened_phase: ClassVar[Phase]
    # Whether each tag is one token the engine core follows (a thinking budget, a grammar that
    # starts after the thinking); harmony's channels are several tokens, so it does not.
    token_tags: ClassVar[bool] = True
    # Whether the parser reads special tokens in the output text (the response keeps them).
    keeps_special_tokens: ClassVar[bool] = False

    def initial_phase(self, prompt: str | None) -> Phase:
        """Where the output of a request with this prompt text starts (None: no text known)."""
        tail = (prompt or "").rstrip()
        if tail.endswith(self.end_tag):
            return Phase.ANSWERING
        if tail.endswith(self.start_tag):
            return Phase.THINKING
        return self.unopened_phase

    def stream(self, prompt: str | None = None) -> ReasoningStream:
        """A fresh incremental splitter for one response to `prompt` (its text)."""
        return ReasoningStream(self, self.initial_phase(prompt))

    def split(self, text: str, prompt: str | None = None) -> ReasoningSplit:
        """A whole response's thinking and answer. The same rules as `stream`: streaming a text
        in any pieces gives the same parts."""
        stream = self.stream(prompt)
        head, tail = stream.feed(text), stream.finish()
        return ReasoningSplit(
            head.reasoning + tail.reasoning if stream.thought else None,
            head.content + tail.content if stream.phase == Phase.ANSWERING else None,
        )


class ReasoningStream:
    """Splits one response's text fed in pieces. A piece that may be the start of a tag is held
    back until the next piece (or `finish`) says whether it is one."""

    def __init__(self, parser: ReasoningParser, phase: Phase) -> None:
        self._start, self._end = parser.start_tag, parser.end_tag
        self.phase = phase
        self.thought = phase == Phase.THINKING  # whether any thinking began
        self._opening = phase == Phase.THINKING  # a repeated start tag may still come first
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        """The parts the text generated since the last call adds."""
        delta = ReasoningDelta()
        text = self._held + text
        self._held = ""
        while text:
            if self.phase == Phase.UNDECIDED or self._opening:
                if len(text) < len(self._start) and self._start.startswith(text):  # maybe the tag, not whole yet
                    self._held = text
                    return delta
                opens = text.startswith(self._start)
                if opens:
                    text = text[len(self._start):]
                if self.phase == Phase.UNDECIDED:
                    self.phase = Phase.THINKING if opens else Phase.ANSWERING
                    self.thought = opens
                self._opening = False
            elif self.phase == Phase.THINKING:
                at = text.find(self._end)
                if at >= 0:
                    delta.reasoning += text[:at]
                    text = text[at + len(self._end):]
                    self.phase = Phase.ANSWERING
                    continue
                keep = _partial_suffix(text, self._end)
                delta.reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep:]
                return delta
            else:
                delta.content += text
                return delta
        return delta

    def finish(self) -> ReasoningDelta:
        """What was held back, once the response has ended: a tag that never completed is text."""
        held, self._held = self._held, ""
        if self.phase == Phase.UNDECIDED:
            self.phase = Phase.ANSWERING
        self._opening = False
        if self.phase == Phase.THINKING:
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
