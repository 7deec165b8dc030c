"""Streaming token ids to text, one step at a time, without ever splitting a character.

A token can end in the middle of a multi-byte UTF-8 character (byte-level BPE pieces, or
sentencepiece byte-fallback tokens), and some decoders treat the first token of a text specially.
So instead of decoding each token alone, we decode a short window of recent tokens twice: the part
already emitted (ids[prefix:read]) and the same part plus the new tokens (ids[prefix:]). The
difference is the new text, emitted only once it no longer ends in U+FFFD (an incomplete
character). The cost per step is O(window), independent of how long the output already is.
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one generated sequence; call `add_tokens` per step and `flush` at the end."""

    __slots__ = ("_decode", "_skip", "_ids", "_prefix_offset", "_read_offset", "_prefix_text", "_chunks")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window: text before it is emitted and settled
        self._read_offset = 0  # text of ids[:read_offset] is emitted
        self._prefix_text: str | None = ""  # decode(ids[prefix:read]); None until needed again
        self._chunks: list[str] = []

    def add_tokens(self, ids: Sequence[int]) -> str:
        """The new text these tokens complete ("" while a character is still incomplete)."""
        if not ids:
            return ""
        self._ids.extend(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD, as in decode)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(final=True)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _advance(self, final: bool) -> str:
        ids, start = self._ids, self._prefix_offset
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(ids[start : self._read_offset], self._skip)
        new_text = self._decode(ids[start:], self._skip)
        if (not final and new_text[-1:] == _REPLACEMENT) or len(new_text) < len(prefix_text):
            return ""  # a character is still incomplete: wait for the next token
        delta = new_text[len(prefix_text) :]
        # The window slides: what was new becomes the context for the next step. It slides even
        # when the tokens added no text (skipped special tokens), so the window stays short.
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = None
        if delta:
            self._chunks.append(delta)
        return delta
