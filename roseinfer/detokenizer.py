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

    __slots__ = (
        "_decode", "_skip", "_dropped", "_ids", "_prefix_offset", "_read_offset", "_prefix_text", "_chunks"
    )

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        # Special tokens that decode skips are left out of the window too: they are no context for
        # the text around them, and a run of them would otherwise keep the window from sliding.
        self._dropped = tokenizer.skipped_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window: text before it is emitted and settled
        self._read_offset = 0  # text of ids[:read_offset] is emitted
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._chunks: list[str] = []

    def add_tokens(self, ids: Sequence[int]) -> str:
        """The new text these tokens complete ("" while a character is still incomplete)."""
        if self._dropped:
            ids = [i for i in ids if i not in self._dropped]
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
        new_text = self._decode(ids[start:], self._skip)
        prefix_text = self._prefix_text
        if (not final and new_text[-1:] == _REPLACEMENT) or len(new_text) < len(prefix_text):
            return ""  # a character is still incomplete: wait for the next token
        delta = new_text[len(prefix_text) :]
        # The window slides to the tokens just read only when, decoded alone, they give exactly the
        # text they added and it is not empty: only then are they context that decodes the next
        # tokens as the whole text would. (Sentencepiece decoders drop the leading space of the
        # first piece: a lone '▁' decodes to "" alone, and a word after it would lose its space.)
        # Otherwise the window keeps its start and grows by these tokens.
        if delta and self._decode(ids[self._read_offset :], self._skip) == delta:
            self._prefix_offset, self._prefix_text = self._read_offset, delta
        else:
            self._prefix_text = new_text
        self._read_offset = len(ids)
        if delta:
            self._chunks.append(delta)
        return delta
