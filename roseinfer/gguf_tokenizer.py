"""The tokenizer pipeline a GGUF file describes under llama.cpp's `tokenizer.ggml.*` keys.

A GGUF carries no tokenizer.json: it stores the vocabulary (with scores, token types and, for BPE,
merges) and names its algorithm in `tokenizer.ggml.model`. One builder per algorithm assembles the
`tokenizers` pipeline that gives the ids transformers gives loading the same file
(`from_pretrained(dir, gguf_file=...)`) and, where transformers has no GGUF loader (WordPiece), the
ids of the model's own Hugging Face tokenizer. A new kind is one builder and one registry entry.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from roseinfer.errors import ModelLoadError

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's `llama_token_type`).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6
_ADDED_TYPES = frozenset({TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED})

SPECIAL_NAMES = ("bos", "eos", "unk", "pad")
_GGUF_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
}
_SPIECE = "▁"  # sentencepiece's stand-in for a space

# Split regexes of the byte-level BPE families, as in each family's own tokenizer.json.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> how llama.cpp (llama-vocab.cpp) splits text before BPE. "gpt2" is the
# GPT-2 regex of the ByteLevel pre-tokenizer; "digits" splits every digit off first, then GPT-2.
_PRE_TOKENIZER_FAMILIES: dict[str, tuple[str, ...]] = {
    "gpt2": (
        "default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling",
        "exaone4", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code",
        "roberta-bpe", "gigachat", "a.x-4.0", "mellum", "modern-bert",
    ),
    "digits": (
        "smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b", "mellum2",
    ),
    "llama3": (
        "llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3", "falcon-h1", "dbrx", "pixtral",
        "midm-2.0", "lfm2", "jina-v5-nano", "glm4", "chatglm-bpe",
    ),
    "qwen2": (
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
    ),
    "qwen35": ("qwen35",),
    "gpt4o": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    "tekken": ("tekken",),
}
_PRE_TO_FAMILY = {pre: family for family, names in _PRE_TOKENIZER_FAMILIES.items() for pre in names}
_FAMILY_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT,
    "gpt4o": _GPT4O_SPLIT, "tekken": _TEKKEN_SPLIT,
}
# llama.cpp matches a whole pre-token against the vocabulary before merging for these families
# (the same as `ignore_merges` in their tokenizer.json), and adds BOS when the file does not say.
_IGNORE_MERGES_FAMILIES = frozenset({"llama3", "tekken"})
_ADD_BOS_FAMILIES = frozenset({"llama3", "tekken"})


@dataclass
class GGUFVocab:
    """A file's vocabulary as read: the tokens, their types and the whole metadata."""

    metadata: dict[str, Any]
    tokens: list[str]
    types: list[int]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def special_id(self, key: str) -> int | None:
        value = self.metadata.get(key)
        if isinstance(value, int) and 0 <= value < len(self.tokens):
            return value
        if key == _GGUF_SPECIAL_ID_KEYS["unk"]:  # converters often leave it out; the type says it
            return next((i for i, kind in enumerate(self.types) if kind == TOKEN_TYPE_UNKNOWN), None)
        return None


@dataclass
class BuiltTokenizer:
    """A builder's result: the pipeline (added tokens still to come) and what encode() adds by
    default when the file does not say (`tokenizer.ggml.add_bos_token` / `add_eos_token`)."""

    backend: BackendTokenizer
    add_bos: bool = False
    add_eos: bool = False
    # The tokens as the pipeline spells them (a builder may respell the file's), for the added tokens.
    tokens: list[str] | None = None
    # The token a kind appends in place of EOS (WordPiece: [SEP]) and its own add flag's key.
    end_key: str | None = None
    # Flags that override the file's add_bos_token / add_eos_token (Gemma 4: the template writes
    # <bos> itself; WordPiece: add_sep_token decides about [SEP]).
    forced_add_bos: bool | None = None
    forced_add_eos: bool | None = None
    # User-defined tokens are added only when the pipeline's vocabulary spells them the same.
    user_defined_in_vocab_only: bool = False


@dataclass
class GGUFTokenizerParts:
    """Everything `Tokenizer` needs from a GGUF file's tokenizer metadata."""

    backend: BackendTokenizer
    named: dict[str, str | None]  # bos/eos/unk/pad -> token text
    ids: dict[str, int | None]  # bos/eos/unk/pad -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None


Builder = Callable[[GGUFVocab], BuiltTokenizer]


def build_gguf_tokenizer(metadata: dict[str, Any]) -> GGUFTokenizerParts:
    """The pipeline and special tokens of the tokenizer a GGUF file's metadata describes."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("the GGUF metadata has no tokenizer (tokenizer.ggml.tokens is missing)")
    tokens = [str(t) for t in tokens]
    types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer: {len(types)} token types for {len(tokens)} tokens")
    vocab = GGUFVocab(metadata, tokens, types)
    builder = _select_builder(str(kind), vocab.architecture)
    built = builder(vocab)

    ids = {name: vocab.special_id(key) for name, key in _GGUF_SPECIAL_ID_KEYS.items()}
    spelled = built.tokens or tokens
    named = {name: spelled[i] if i is not None else None for name, i in ids.items()}
    _add_gguf_added_tokens(built, spelled, types, ids, tokens)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", built.add_bos))
    if built.forced_add_bos is not None:
        add_bos = built.forced_add_bos
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", built.add_eos))
    if built.forced_add_eos is not None:
        add_eos = built.forced_add_eos
    end = vocab.special_id(built.end_key) if built.end_key else None
    if end is not None:
        ids["eos"], named["eos"] = end, spelled[end]
    return GGUFTokenizerParts(
        backend=built.backend, named=named, ids=ids, add_bos=add_bos, add_eos=add_eos,
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _select_builder(kind: str, architecture: str) -> Builder:
    if kind == "llama":  # sentencepiece BPE: some families spell or split it their own way
        for prefix, builder in _SENTENCEPIECE_BY_ARCHITECTURE.items():
            if architecture.startswith(prefix):
                return builder
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer: tokenizer.ggml.model = {kind!r} "
            f"(roseinfer supports {', '.join(repr(k) for k in _BUILDERS)})"
        )
    return builder


# -- byte-level BPE ("gpt2") ------------------------------------------------------------------------


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value: printable Latin-1 bytes stand for
    themselves, the rest (controls, space, ...) are shifted past U+0100 in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [""] * 256, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return chars


BYTE_CHARS = _gpt2_byte_chars()
_BYTE_ALPHABET = frozenset(BYTE_CHARS)


def _byte_level_spelling(text: str) -> str:
    return "".join(BYTE_CHARS[b] for b in text.encode("utf-8"))


def _byte_level(vocab: GGUFVocab) -> BuiltTokenizer:
    metadata = vocab.metadata
    merges = _split_merges(metadata.get("tokenizer.ggml.merges"))
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    family = _PRE_TO_FAMILY.get(pre)
    if family is None:
        logger.warning(
            "GGUF tokenizer.ggml.pre = %r is not known to roseinfer; splitting text with the GPT-2 "
            "regex, which may give different token ids than the model was trained with", pre,
        )
        family = "gpt2"

    # Normal tokens are stored in the byte-level alphabet; one a converter wrote as raw text is
    # respelled so BPE can still reach it. Control/user-defined tokens keep their raw text: they
    # become added tokens, matched in the text as written.
    table = {
        token if kind in _ADDED_TYPES or set(token) <= _BYTE_ALPHABET else _byte_level_spelling(token): i
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
    }
    try:
        bpe = models.BPE(vocab=table, merges=merges, ignore_merges=family in _IGNORE_MERGES_FAMILIES)
    except Exception as exc:
        raise ModelLoadError(f"the GGUF byte-level BPE vocabulary is inconsistent: {exc}") from exc

    backend = BackendTokenizer(bpe)
    if family == "gpt2":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif family == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_FAMILY_SPLITS[family]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return BuiltTokenizer(backend, add_bos=family in _ADD_BOS_FAMILIES)


# -- sentencepiece BPE ("llama", "gemma4") ------------------------------------------------------------


def _sentencepiece_bpe(vocab: GGUFVocab, tokens: list[str], merge_ranks: dict[str, float] | None) -> BackendTokenizer:
    """A sentencepiece vocabulary as a BPE with byte fallback: merges from the file, or recovered
    from `merge_ranks` (a rank per token, best highest; the file's scores when None)."""
    metadata = vocab.metadata
    table = {token: i for i, token in enumerate(tokens)}
    if metadata.get("tokenizer.ggml.merges"):
        merges = _split_merges(metadata["tokenizer.ggml.merges"])
    else:
        if merge_ranks is None:
            scores = metadata.get("tokenizer.ggml.scores")
            if not scores or len(scores) != len(tokens):
                raise ModelLoadError(
                    "GGUF sentencepiece tokenizer has neither tokenizer.ggml.merges nor one "
                    "tokenizer.ggml.scores entry per token, so its merges cannot be recovered"
                )
            merge_ranks = dict(zip(tokens, scores, strict=True))
        merges = _merges_from_scores(table, merge_ranks)
    unk_id = vocab.special_id(_GGUF_SPECIAL_ID_KEYS["unk"])
    unk = tokens[unk_id] if unk_id is not None else None
    try:
        bpe = models.BPE(vocab=table, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as exc:
        raise ModelLoadError(f"the GGUF sentencepiece vocabulary is inconsistent: {exc}") from exc
    return BackendTokenizer(bpe)


def _spm_decoder(strip_prefix: bool) -> decoders.Decoder:
    steps = [decoders.Replace(_SPIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def _sentencepiece(vocab: GGUFVocab) -> BuiltTokenizer:
    """llama.cpp's SPM vocabulary as transformers' LlamaTokenizer builds it."""
    backend = _sentencepiece_bpe(vocab, vocab.tokens, None)
    # Spaces become "▁"; sentencepiece also puts one in front of the text (add_space_prefix).
    prefix = bool(vocab.metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPIECE, prepend_scheme="first" if prefix else "never", split=False
    )
    backend.decoder = _spm_decoder(prefix)
    return BuiltTokenizer(backend, add_bos=True)  # llama.cpp adds BOS to SPM unless the file says not


def _phi3(vocab: GGUFVocab) -> BuiltTokenizer:
    """Phi-3's sentencepiece: the "▁" in front is prepended to the text always, even one that
    starts with a space (Metaspace would not add a second), as llama.cpp does."""
    backend = _sentencepiece_bpe(vocab, vocab.tokens, None)
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(_SPIECE), normalizers.Replace(" ", _SPIECE)]
    )
    backend.decoder = _spm_decoder(True)
    return BuiltTokenizer(backend, add_bos=True)


def _gemma(vocab: GGUFVocab) -> BuiltTokenizer:
    """Gemma 1/2/3's sentencepiece: no prefix space, every space a "▁" (no word splitting).

    llama.cpp's converter writes Gemma's whitespace-run tokens ("▁▁", ...) with real spaces, and
    lists no merges; they are rebuilt from the vocabulary ranked by position in the file (Gemma's
    scores do not follow its merge order), as transformers does with the same file."""
    tokens = [_SPIECE * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]
    ranks = {token: -float(i) for i, token in enumerate(tokens)}
    backend = _sentencepiece_bpe(vocab, tokens, ranks)
    backend.normalizer = normalizers.Replace(" ", _SPIECE)
    backend.decoder = _spm_decoder(False)
    return BuiltTokenizer(backend, add_bos=True, tokens=tokens, user_defined_in_vocab_only=True)


def _gemma4(vocab: GGUFVocab) -> BuiltTokenizer:
    """Gemma 4 ("gemma4"): Gemma's pipeline with the merges the file lists. The file asks for BOS,
    but the reference tokenizer adds none (the chat template writes <bos>), as transformers."""
    backend = _sentencepiece_bpe(vocab, vocab.tokens, None)
    backend.normalizer = normalizers.Replace(" ", _SPIECE)
    backend.decoder = _spm_decoder(False)
    return BuiltTokenizer(backend, forced_add_bos=False, user_defined_in_vocab_only=True)


# -- sentencepiece Unigram ("t5") ------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"^\[PAD\d+\]$")
_T5_SENTINELS = 100


def _unigram(vocab: GGUFVocab) -> BuiltTokenizer:
    """A sentencepiece Unigram vocabulary (T5 and its embedding descendants): pieces with scores,
    text normalized by the file's precompiled character map, whitespace runs collapsed.

    The converter pads T5's vocabulary with `[PADn]` where T5 has its sentinels; the first 100 are
    named back to `<extra_id_99>`..`<extra_id_0>`, as transformers does with the same file."""
    metadata = vocab.metadata
    scores = metadata.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(vocab.tokens):
        raise ModelLoadError("GGUF unigram tokenizer needs one tokenizer.ggml.scores entry per token")
    tokens = list(vocab.tokens)
    blanks = [i for i, token in enumerate(tokens) if _PLACEHOLDER.match(token)]
    for offset, index in enumerate(blanks[:_T5_SENTINELS]):
        tokens[index] = f"<extra_id_{_T5_SENTINELS - 1 - offset}>"
    unk_id = vocab.special_id(_GGUF_SPECIAL_ID_KEYS["unk"])
    byte_fallback = TOKEN_TYPE_BYTE in vocab.types
    try:
        unigram = models.Unigram(
            [(t, float(s)) for t, s in zip(tokens, scores, strict=True)], unk_id=unk_id, byte_fallback=byte_fallback
        )
    except Exception as exc:
        raise ModelLoadError(f"the GGUF unigram vocabulary is inconsistent: {exc}") from exc
    backend = BackendTokenizer(unigram)
    backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in blanks[:_T5_SENTINELS]])

    steps: list[normalizers.Normalizer] = []
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(int(b) & 0xFF for b in charsmap)))
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", True):
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if steps:
        backend.normalizer = normalizers.Sequence(steps)
    prefix = "always" if metadata.get("tokenizer.ggml.add_space_prefix", True) else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPIECE, prepend_scheme=prefix, split=True)
    backend.decoder = decoders.Sequence([
        *([decoders.ByteFallback()] if byte_fallback else []),
        decoders.Metaspace(replacement=_SPIECE, prepend_scheme=prefix, split=True),
    ])
    # T5 ends every text with </s> and starts with nothing (llama.cpp's default for UGM too).
    return BuiltTokenizer(backend, add_bos=False, add_eos=True, tokens=tokens)


# -- WordPiece ("bert") ----------------------------------------------------------------------------------


def _wordpiece(vocab: GGUFVocab) -> BuiltTokenizer:
    """BERT's WordPiece, as llama.cpp runs it: lowercased, accents stripped, split on whitespace and
    punctuation, CJK characters alone, longest match first.

    llama.cpp's converter respells the vocabulary: a word-starting piece gets "▁" in front, a
    continuation ("##ing") loses its "##"; control tokens ([CLS], ...) stay as they are. Undone
    here, so that the pieces are BERT's own."""
    table: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if kind == TOKEN_TYPE_CONTROL:
            piece = token
        elif token.startswith(_SPIECE):
            piece = token[len(_SPIECE):]
        else:
            piece = "##" + token
        table.setdefault(piece, i)
    unk_id = vocab.special_id(_GGUF_SPECIAL_ID_KEYS["unk"])
    unk = vocab.tokens[unk_id] if unk_id is not None else "[UNK]"
    backend = BackendTokenizer(models.WordPiece(table, unk_token=unk, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    # [CLS] text [SEP]: the converter writes [CLS] as BOS and [SEP] as the separator, whose own
    # flag (add_sep_token) says whether it ends the text, as llama.cpp reads it.
    add_sep = bool(vocab.metadata.get("tokenizer.ggml.add_sep_token", True))
    return BuiltTokenizer(
        backend, add_bos=True, forced_add_eos=add_sep, end_key="tokenizer.ggml.seperator_token_id"
    )


_BUILDERS: dict[str, Builder] = {
    "gpt2": _byte_level,
    "llama": _sentencepiece,
    "gemma4": _gemma4,
    "t5": _unigram,
    "bert": _wordpiece,
}
# tokenizer.ggml.model = "llama" files whose family spells or splits sentencepiece its own way.
_SENTENCEPIECE_BY_ARCHITECTURE: dict[str, Builder] = {"gemma": _gemma, "phi3": _phi3}


# -- shared ----------------------------------------------------------------------------------------------


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a token into two tokens,
    best score first, ties broken the way transformers does it so that the ids agree."""
    candidates = []  # (score of the merged token, left, right), in vocabulary order
    for token, score in scores.items():
        pairs = [
            (token[:i], token[i:]) for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((score, left, right) for left, right in pairs)
    # sorted() is stable: equal keys keep vocabulary order.
    candidates.sort(key=lambda c: (-c[0], -len(c[1]), -len(c[2])))
    return [(left, right) for _, left, right in candidates]


def _split_merges(merges: Any) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges or ():
        left, sep, right = str(merge).partition(" ")
        if not sep:
            raise ModelLoadError(f"GGUF tokenizer.ggml.merges has a malformed entry: {merge!r}")
        pairs.append((left, right))
    return pairs


def _add_gguf_added_tokens(
    built: BuiltTokenizer, tokens: list[str], types: list[int], named_ids: dict[str, int | None],
    file_tokens: list[str],
) -> None:
    """Control tokens (and the named BOS/EOS/UNK/PAD if not normal text) become special added tokens,
    user-defined ones plain added tokens: either way they are matched whole in the text."""
    named = {i for i in named_ids.values() if i is not None}
    special = [
        AddedToken(token, normalized=False, special=True)
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind == TOKEN_TYPE_CONTROL or (i in named and kind != TOKEN_TYPE_NORMAL)
    ]
    # Where a builder respelled the vocabulary (Gemma's whitespace runs), a user-defined token
    # whose spelling changed is left to the model (BPE reaches it), as transformers does.
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind, original in zip(tokens, types, file_tokens, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED and (not built.user_defined_in_vocab_only or token == original)
    ]
    if special:
        built.backend.add_special_tokens(special)
    if user:
        built.backend.add_tokens(user)
