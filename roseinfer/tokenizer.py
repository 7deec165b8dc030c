"""Text <-> token ids with Hugging Face's `tokenizers`, built from GGUF metadata or a model directory.

The BPE itself always runs in the Rust library; this module only assembles the right pipeline
(vocabulary, merges, pre-tokenizer, decoder, special tokens) for a model, so that `encode` gives
the ids the model was trained on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from roseinfer.chat_template import render_chat_template
from roseinfer.errors import ModelLoadError
from roseinfer.gguf_tokenizer import BYTE_CHARS, SPECIAL_NAMES, build_gguf_tokenizer
from roseinfer.special_token_guard import RenderedChat, SpecialTokenGuard

logger = logging.getLogger(__name__)

_SPECIAL_NAMES = SPECIAL_NAMES
# llguidance reads byte-level pieces with the same table.
_BYTE_CHARS = BYTE_CHARS


# tokenizers' `encode` holds the GIL for the whole call (about 4 s for a prompt of 900k characters
# here), so a huge prompt tokenized in a worker thread would still stop the server's event loop and
# engine thread; its batch calls release the GIL (and encode the same ids). Short texts keep the
# plain call, which is quicker for them.
_GIL_FREE_FROM_CHARS = 4096


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what a model's configuration says around it."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        vocab_size: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Ids given explicitly (GGUF metadata) win over looking the strings up.
        self.bos_token_id = bos_token_id if bos_token_id is not None else _token_id(backend, bos_token)
        self.eos_token_id = eos_token_id if eos_token_id is not None else _token_id(backend, eos_token)
        self._template_tokens = {
            f"{name}_token": token
            for name, token in zip(_SPECIAL_NAMES, (bos_token, eos_token, unk_token, pad_token), strict=True)
            if token is not None
        }
        # What encode(add_special_tokens=True) really does, whatever the config files claimed.
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token = bool(probe) and self.bos_token_id is not None and probe[0] == self.bos_token_id
        self.vocab_size = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        # The ids decode(skip_special_tokens=True) drops before decoding the rest.
        self.skipped_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )
        # Those plus the named BOS/EOS/UNK/PAD.
        special = set(self.skipped_ids)
        named = [_token_id(backend, token) for token in self._template_tokens.values()]
        special.update(i for i in (*named, self.bos_token_id, self.eos_token_id) if i is not None)
        self.all_special_ids = frozenset(special)
        # transformers >= 5 ignores clean_up_tokenization_spaces for BPE models: it deletes real spaces.
        self._clean_up = clean_up_tokenization_spaces and not isinstance(backend.model, models.BPE)
        self._backend_decode = backend.decode

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file describes under llama.cpp's `tokenizer.ggml.*` keys
        (gguf_tokenizer.py builds the pipeline for each `tokenizer.ggml.model`)."""
        parts = build_gguf_tokenizer(metadata)
        named, ids = parts.named, parts.ids
        _set_bos_eos_processor(
            parts.backend, named["bos"], ids["bos"], parts.add_bos, named["eos"], ids["eos"], parts.add_eos
        )
        return cls(
            parts.backend,
            chat_template=parts.chat_template,
            bos_token=named["bos"],
            eos_token=named["eos"],
            unk_token=named["unk"],
            pad_token=named["pad"],
            clean_up_tokenization_spaces=False,
            vocab_size=len(metadata["tokenizer.ggml.tokens"]),
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face tokenizer directory: tokenizer.json, or GPT-2 style vocab.json + merges.txt."""
        directory = Path(path)
        if not directory.is_dir():
            raise ModelLoadError(f"tokenizer directory {directory} does not exist or is not a directory")
        config = _read_json(directory / "tokenizer_config.json") or {}
        legacy_map = _read_json(directory / "special_tokens_map.json") or {}
        named = {
            name: _token_content(config.get(f"{name}_token", legacy_map.get(f"{name}_token")))
            for name in _SPECIAL_NAMES
        }

        if (directory / "tokenizer.json").is_file():
            try:
                backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
            except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
                raise ModelLoadError(f"{directory / 'tokenizer.json'} could not be read: {exc}") from exc
            # Some files carry training-time truncation/padding; prompts must go through whole.
            backend.no_truncation()
            backend.no_padding()
            # tokenizer.json's post-processor decides about BOS/EOS; transformers ignores the
            # config's add_bos_token/add_eos_token when that file exists, and so do we.
            set_bos_eos = False
        elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            backend = _byte_level_from_vocab_merges(directory, config)
            # GPT-2 style directories often name no special tokens; GPT-2's own default is this one.
            if not any(named.values()) and backend.token_to_id("<|endoftext|>") is not None:
                named.update(bos="<|endoftext|>", eos="<|endoftext|>", unk="<|endoftext|>")
            set_bos_eos = True
        else:
            present = sorted(p.name for p in directory.iterdir())[:20]
            raise ModelLoadError(
                f"no tokenizer in {directory}: expected tokenizer.json, or vocab.json + merges.txt "
                f"(found: {', '.join(present) or 'nothing'})"
            )

        # Named special tokens the backend does not know as added tokens yet become special ones,
        # so that they are matched whole in text and skipped by decode(skip_special_tokens=True).
        added = {token.content for token in backend.get_added_tokens_decoder().values()}
        missing = [
            t for t in dict.fromkeys(named.values())
            if t and t not in added and backend.token_to_id(t) is not None
        ]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

        if set_bos_eos:
            _set_bos_eos_processor(
                backend,
                named["bos"], _token_id(backend, named["bos"]), bool(config.get("add_bos_token")),
                named["eos"], _token_id(backend, named["eos"]), bool(config.get("add_eos_token")),
            )
        return cls(
            backend,
            chat_template=_find_chat_template(directory, config),
            bos_token=named["bos"],
            eos_token=named["eos"],
            unk_token=named["unk"],
            pad_token=named["pad"],
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # -- use --------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_FROM_CHARS:
            return self.encode_batch([text], add_special_tokens)[0]
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips computing offsets we do not use.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encodings = encode(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            text = self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError:  # tuples, numpy/torch integers: give Rust a plain list of ints
            text = self._backend_decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            text = _clean_up_tokenization(text)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for a conversation, from the model's own chat template.

        Encode the result with add_special_tokens=False: templates write their own BOS. (The
        text of a request from a caller goes through `render_chat` and `encode_chat` instead.)
        """
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template (none in its GGUF metadata or tokenizer files); "
                "send a plain text prompt instead of chat messages"
            )
        variables = {**self._template_tokens, **kwargs}
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None, *, parse_special_tokens: bool = False,
    ) -> RenderedChat:
        """`apply_chat_template` with the template `variables`, remembering where special-token
        strings in the messages and variables (what a caller sent) ended up, so that
        `encode_chat` keeps them text (see special_token_guard.py). `parse_special_tokens=True`:
        they become special tokens, as the template's own markup does (transformers' and vLLM's
        behaviour). The variables are a dict, not keywords: no name in them collides with ours."""
        variables = variables or {}
        if parse_special_tokens:
            return RenderedChat(self.apply_chat_template(messages, add_generation_prompt, **variables))
        guard = self._special_token_guard
        text = self.apply_chat_template(guard.hide(messages), add_generation_prompt, **guard.hide(variables))
        return guard.restore(text)

    def encode_chat(self, chat: RenderedChat) -> list[int]:
        """The ids of a rendered chat (no BOS added: templates write their own): its literal spans
        tokenized as text, the rest as `encode` does."""
        if not chat.literal_spans:
            return self.encode(chat.text, add_special_tokens=False)
        if len(chat.text) > _GIL_FREE_FROM_CHARS:  # the offsets are needed: the batch call that keeps them
            encoding = self.backend.encode_batch([chat.text], add_special_tokens=False)[0]
        else:
            encoding = self.backend.encode(chat.text, add_special_tokens=False)
        ids: list[int] = []
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token_id in self.skipped_ids and chat.is_literal(start, end):
                ids.extend(self._text_backend.encode(chat.text[start:end], add_special_tokens=False).ids)
            else:
                ids.append(token_id)
        return ids

    @cached_property
    def _special_token_guard(self) -> SpecialTokenGuard:
        decoder = self.backend.get_added_tokens_decoder()
        return SpecialTokenGuard(token.content for token in decoder.values() if token.special)

    @cached_property
    def _text_backend(self) -> BackendTokenizer:
        """A copy of the backend that tokenizes special-token strings as the text they are."""
        backend = BackendTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
            f"add_bos_token={self.add_bos_token})"
        )


# -- shared ----------------------------------------------------------------------------------------


def _set_bos_eos_processor(
    backend: BackendTokenizer,
    bos: str | None, bos_id: int | None, add_bos: bool,
    eos: str | None, eos_id: int | None, add_eos: bool,
) -> None:
    """Make encode(add_special_tokens=True) add exactly the requested BOS/EOS."""
    add_bos = add_bos and bos is not None and bos_id is not None
    add_eos = add_eos and eos is not None and eos_id is not None
    first = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    second = ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [(bos, bos_id)] if add_bos else []
    if add_eos and eos != bos:
        specials.append((eos, eos_id))
    try:
        backend.post_processor = processors.TemplateProcessing(
            single=first, pair=first + second, special_tokens=specials
        )
    except Exception as exc:  # a token containing ":" cannot be written in a template
        logger.warning("cannot make encode() add BOS %r / EOS %r (%s); adding none", bos, eos, exc)
        backend.post_processor = processors.TemplateProcessing(
            single=["$A:0"], pair=["$A:0", "$B:1"], special_tokens=[]
        )


# -- Hugging Face directories ---------------------------------------------------------------------


def _byte_level_from_vocab_merges(directory: Path, config: dict[str, Any]) -> BackendTokenizer:
    try:
        bpe = models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
    except Exception as exc:
        raise ModelLoadError(f"vocab.json/merges.txt in {directory} could not be read: {exc}") from exc
    backend = BackendTokenizer(bpe)
    add_prefix_space = bool(config.get("add_prefix_space", False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    backend.decoder = decoders.ByteLevel()

    # Added tokens live in tokenizer_config.json (newer) or added_tokens.json (older).
    added: list[AddedToken] = []
    for entry in (config.get("added_tokens_decoder") or {}).values():
        added.append(AddedToken(
            entry["content"],
            single_word=entry.get("single_word", False),
            lstrip=entry.get("lstrip", False),
            rstrip=entry.get("rstrip", False),
            normalized=entry.get("normalized", not entry.get("special", False)),
            special=entry.get("special", False),
        ))
    for content in sorted(_read_json(directory / "added_tokens.json") or {}):
        if not any(token.content == content for token in added):
            added.append(AddedToken(content, special=False))
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def _find_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """Newer transformers saves the template beside the config; older ones inside it."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = (_read_json(directory / "chat_template.json") or {}).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} should hold a JSON object")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config spells it: a string, or a dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _token_id(backend: BackendTokenizer, token: str | None) -> int | None:
    return backend.token_to_id(token) if token is not None else None


def _clean_up_tokenization(text: str) -> str:
    """Undo the spaces a word-piece tokenizer puts before punctuation and contractions."""
    for spaced, joined in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
