"""llguidance's view of a roseinfer tokenizer: the bytes of every token id (special tokens marked
so that no grammar text can produce them), the end-of-sequence ids, and a canonical encoder.

Works from the `tokenizers` pipeline our Tokenizer assembled, so GGUF-built and tokenizer.json
tokenizers are handled alike: byte-level BPE (GPT-2 alphabet) and sentencepiece-style
vocabularies ("▁" for spaces, <0xNN> byte-fallback tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import llguidance
from tokenizers import Tokenizer as BackendTokenizer

from roseinfer.errors import ModelLoadError
from roseinfer.tokenizer import _BYTE_CHARS, Tokenizer

# llguidance's marker for special tokens: 0xFF never occurs in UTF-8 text.
SPECIAL_TOKEN_MARKER = b"\xff"


def build_llg_tokenizer(
    tokenizer: Tokenizer,
    *,
    vocab_size: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer`, with `vocab_size` ids (the model's logits width,
    when larger than the tokenizer's vocabulary: the extra ids are never allowed).

    `eos_token_ids` are the ids a finished grammar allows (default: the tokenizer's EOS).
    Takes about a second for a 150k vocabulary: build it once per model.
    """
    eos = sorted(set(eos_token_ids or ())) or (
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    )
    if not eos:
        raise ModelLoadError(
            "structured outputs need an end-of-sequence token, and this tokenizer names none"
        )
    table = token_bytes_table(tokenizer)
    size = max(vocab_size or 0, len(table))
    table.extend(b"" for _ in range(size - len(table)))  # ids past the vocabulary: never allowed
    if max(eos) >= size:
        raise ModelLoadError(f"end-of-sequence id {max(eos)} is outside the vocabulary ({size})")
    special = sorted(i for i, token in enumerate(table) if token.startswith(SPECIAL_TOKEN_MARKER))
    view = _TokenizerView(tokenizer, table, eos[0], special)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), eos_token=eos)


def token_bytes_table(tokenizer: Tokenizer) -> list[bytes]:
    """Each id's bytes as they appear in decoded text; special tokens get the marker in front;
    ids the vocabulary does not use get b""."""
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    special_ids = tokenizer.all_special_ids
    piece_bytes = _piece_decoder(backend)
    table = []
    for token_id in range(tokenizer.vocab_size):
        piece = backend.id_to_token(token_id)
        if piece is None:
            table.append(b"")
        elif token_id in special_ids or (token_id in added and added[token_id].special):
            table.append(SPECIAL_TOKEN_MARKER + piece.encode("utf-8"))
        elif token_id in added:  # user-defined added tokens are matched and decoded as written
            table.append(added[token_id].content.encode("utf-8"))
        else:
            table.append(piece_bytes(piece))
    return table


def _piece_decoder(backend: BackendTokenizer):
    """How a vocabulary piece spells its bytes, read from the pipeline's decoder."""
    decoder = backend.decoder
    state = json.loads(decoder.__getstate__()) if decoder is not None else {}
    steps = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
    kinds = {step.get("type") for step in steps}
    if "ByteLevel" in kinds:
        byte_of = {char: byte for byte, char in enumerate(_BYTE_CHARS)}
        # A character outside the GPT-2 alphabet stands for itself (some converters write raw text).
        return lambda piece: b"".join(
            bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in piece
        )
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        space = "▁"
        for step in steps:
            if step.get("type") == "Replace" and step.get("content") == " ":
                space = step.get("pattern", {}).get("String", space)
            if step.get("type") == "Metaspace":
                space = step.get("replacement", space)
        return lambda piece: _spm_piece_bytes(piece, space)
    raise ModelLoadError(
        "structured outputs need a byte-level BPE or a sentencepiece-style tokenizer; this one "
        f"decodes with {state.get('type') or 'no decoder'}"
    )


def _spm_piece_bytes(piece: str, space: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace(space, " ").encode("utf-8")


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS/BOS, special ids, and `__call__`,
    which llguidance uses to turn bytes a grammar forces into tokens the model would use.

    Encoding must give tokens whose bytes are exactly the text. Sentencepiece pipelines put a
    "▁" before the text; a copy of the pipeline without that does the encoding, and any text
    that still comes back different (a special token's text, an unusual normalizer) is encoded
    by longest match over the token table instead.
    """

    def __init__(
        self, tokenizer: Tokenizer, table: list[bytes], eos: int, special: Sequence[int]
    ) -> None:
        self.tokens = table
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(special)
        self._encoder = _without_space_prefix(tokenizer.backend)
        self._ids_by_bytes: dict[bytes, int] = {}
        for token_id, token in enumerate(table):
            if token and not token.startswith(SPECIAL_TOKEN_MARKER):
                self._ids_by_bytes.setdefault(token, token_id)
        self._longest = max(map(len, self._ids_by_bytes), default=1)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes with bytes; we take text only
            raise TypeError("text must be str")
        ids = self._encoder.encode(text, add_special_tokens=False).ids
        if b"".join(self.tokens[i] for i in ids) == text.encode("utf-8"):
            return ids
        return self._longest_match(text.encode("utf-8")) or ids

    def _longest_match(self, data: bytes) -> list[int] | None:
        ids, start = [], 0
        while start < len(data):
            for end in range(min(len(data), start + self._longest), start, -1):
                token_id = self._ids_by_bytes.get(data[start:end])
                if token_id is not None:
                    ids.append(token_id)
                    start = end
                    break
            else:
                return None  # a byte no token spells
        return ids


def _without_space_prefix(backend: BackendTokenizer) -> BackendTokenizer:
    """The pipeline, minus the "▁" sentencepiece puts before the text (a Metaspace pre-tokenizer
    with a prepend scheme, or a Prepend normalizer); the pipeline itself when it has neither."""
    changed = False

    def strip_prefix(node: dict | None) -> dict | None:
        nonlocal changed
        kind = (node or {}).get("type")
        if kind == "Sequence":
            key = "normalizers" if "normalizers" in node else "pretokenizers"
            kept = [strip_prefix(child) for child in node.get(key, [])]
            node[key] = [child for child in kept if child is not None]
        elif kind == "Prepend":
            changed = True
            return None
        elif kind == "Metaspace" and node.get("prepend_scheme", "always") != "never":
            node["prepend_scheme"] = "never"
            changed = True
        return node

    # Read the two small components first; copy the whole pipeline only when one must change.
    parts = {
        key: strip_prefix(json.loads(part.__getstate__()) if part is not None else None)
        for key, part in (("normalizer", backend.normalizer), ("pre_tokenizer", backend.pre_tokenizer))
    }
    if not changed:
        return backend
    config = json.loads(backend.to_str())
    config.update(parts)
    return BackendTokenizer.from_str(json.dumps(config))
