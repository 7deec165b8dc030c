"""Chat prompts in which what a caller typed cannot forge the chat template's markup.

A chat template writes the turns of a conversation with special tokens (`<|im_start|>user ...
<|im_end|>`), and the rendered text is tokenized with special-token strings parsed into their ids,
as vLLM and transformers do. Typed into a message, the same strings became the same ids: a user
could close their turn and open a system one. So the caller's text is kept apart from the markup
(as mistral-common and OpenAI's harmony do by tokenizing contents on their own):

1. before rendering, every special-token string in a value the caller sent (the messages' contents
   and their other strings, the tools, chat_template_kwargs) becomes a placeholder that says which
   token it was: ASCII digits in brackets, which templates' filters (trim, tojson, upper) leave as
   they are;
2. after rendering, each placeholder is put back as the text it replaced, and its span recorded;
3. the text is tokenized in one pass as before, and each special token that overlaps a recorded
   span is replaced by the ids of its text tokenized as text.

So a prompt without special-token strings in the caller's values tokenizes exactly as before, and
around a forged one only that token changes: the tokenizer cuts text at special tokens before
anything else, so the tokens beside it are the ones they were.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RenderedChat:
    """A rendered chat prompt, and the spans of its text to tokenize as text whatever they say
    (the special-token strings that came from the caller's values, in order)."""

    text: str
    literal_spans: tuple[tuple[int, int], ...] = ()

    def is_literal(self, start: int, end: int) -> bool:
        """Whether [start, end) overlaps a literal span."""
        return any(start < span_end and span_start < end for span_start, span_end in self.literal_spans)


class SpecialTokenGuard:
    """Hides a tokenizer's special-token strings in values before rendering, and finds them in
    the rendered text after."""

    def __init__(self, special_tokens: Iterable[str]) -> None:
        # Longest first: at one position the regex takes the first alternative that matches, and
        # the tokenizer matches the longest token.
        self.tokens = sorted({token for token in special_tokens if token}, key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None
        self._index = {token: index for index, token in enumerate(self.tokens)}
        # A fresh nonce a process: text a caller typed does not look like a placeholder by chance.
        nonce = secrets.randbelow(10**12)
        self._placeholder_format = f"[[{nonce}:{{}}]]"
        self._placeholder = re.compile(rf"\[\[{nonce}:(\d+)\]\]")

    def hide(self, value: Any) -> Any:
        """A copy of `value` (JSON-like: dicts, lists, strings, ...) whose strings, keys included,
        have placeholders for special-token strings."""
        if self._special is None:
            return value
        if isinstance(value, str):
            return self._special.sub(self._placeholder_of, value)
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide(item) for item in value]
        return value

    def restore(self, text: str) -> RenderedChat:
        """`text` with each placeholder replaced by its special-token string, and their spans."""
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        length = last = 0
        for match in self._placeholder.finditer(text):
            index = int(match.group(1))
            if index >= len(self.tokens):
                continue
            pieces.append(text[last : match.start()])
            length += match.start() - last
            pieces.append(self.tokens[index])
            spans.append((length, length + len(self.tokens[index])))
            length += len(self.tokens[index])
            last = match.end()
        if not spans:
            return RenderedChat(text)
        pieces.append(text[last:])
        return RenderedChat("".join(pieces), tuple(spans))

    def _placeholder_of(self, match: re.Match[str]) -> str:
        return self._placeholder_format.format(self._index[match.group(0)])
