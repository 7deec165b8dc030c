"""roseinfer.tokenizer against transformers, on the real default model and small offline builds."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from roseinfer.errors import ModelLoadError
from roseinfer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu — naïve façade, Ångström, Œuvre, straße",
    "漢字とひらがなとカタカナ。中文测试，한국어 텍스트",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "def add(a, b):\n\treturn a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "in 2024, 3.14159 and 1,000,000 or 0xFF; 12345678901234567890",
    "spaces:   three,    four\ttab\t\ttwo tabs",
    "line one\nline two\n\n\nafter blank lines\r\nwindows",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "I'm sure they'll say it's fine, won't they? You've done it.",
    "Ünïcödé ∑∫√ ≠ ≤ ≥ ∞ ← → ⊕ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

# Whitespace runs right before a digit: here the GGUF's "smollm" pre-tokenizer (digits split off
# first, like llama.cpp and SmolLM2's own tokenizer.json) and transformers' GGUF loader (plain
# GPT-2 regex, which ignores tokenizer.ggml.pre = "smollm") disagree; see test_smollm_digit_split.
DIGIT_AFTER_WHITESPACE = ["x  2", "\n\n1. first\n2. second", "a\t\t3", "total:    42"]


def hf_encode(hf, text: str, add_special_tokens: bool = True) -> list[int]:
    return hf.encode(text, add_special_tokens=add_special_tokens)


# -- GGUF: the default model ------------------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(smollm_tokenizer, smollm_hf_tokenizer, add_special_tokens):
    for text in CORPUS:
        expected = hf_encode(smollm_hf_tokenizer, text, add_special_tokens)
        assert smollm_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_encode_batch_matches_encode(smollm_tokenizer):
    assert smollm_tokenizer.encode_batch(CORPUS) == [smollm_tokenizer.encode(t) for t in CORPUS]
    assert smollm_tokenizer.encode_batch(CORPUS, add_special_tokens=False) == [
        smollm_tokenizer.encode(t, add_special_tokens=False) for t in CORPUS
    ]


def test_long_texts_encode_as_transformers_does(smollm_tokenizer, smollm_hf_tokenizer, monkeypatch):
    """Past a few thousand characters `encode` and `encode_chat` take tokenizers' batch calls
    (they release the GIL: test_huge_prompt.py); the ids are the same, and special-token markup
    typed into a message still stays text."""
    import roseinfer.tokenizer

    text = " ".join(CORPUS) * 60 + "<|im_start|>system"
    assert len(text) > roseinfer.tokenizer._GIL_FREE_FROM_CHARS
    assert smollm_tokenizer.encode(text) == hf_encode(smollm_hf_tokenizer, text)
    chat = smollm_tokenizer.render_chat([{"role": "user", "content": text}])
    ids = smollm_tokenizer.encode_chat(chat)
    im_start = smollm_hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert chat.text.count("<|im_start|>") > 3
    assert ids.count(im_start) == 3  # the template's own system, user and assistant turns only
    monkeypatch.setattr(roseinfer.tokenizer, "_GIL_FREE_FROM_CHARS", len(chat.text) + 1)
    assert ids == smollm_tokenizer.encode_chat(chat)  # the one-call path's ids


def test_special_token_strings_become_their_ids(smollm_tokenizer):
    ids = smollm_tokenizer.encode("<|im_start|>user")
    assert ids[0] == smollm_tokenizer.bos_token_id == 1
    assert smollm_tokenizer.encode("<|im_end|>") == [smollm_tokenizer.eos_token_id]


def test_smollm_digit_split(smollm_tokenizer, smollm_hf_tokenizer):
    """tokenizer.ggml.pre = "smollm" splits digits off before the GPT-2 regex (llama.cpp), which
    is SmolLM2's upstream pre-tokenizer: Digits(individual_digits) + ByteLevel. transformers' GGUF
    loader skips that step, so the reference here is its backend with the upstream pre-tokenizer."""
    upstream = BackendTokenizer.from_str(smollm_hf_tokenizer.backend_tokenizer.to_str())
    upstream.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    for text in CORPUS + DIGIT_AFTER_WHITESPACE:
        assert smollm_tokenizer.encode(text) == upstream.encode(text).ids, text
    # "\n\n" before a list number is the single token the model was trained with.
    double_newline = smollm_tokenizer.encode("\n\n")
    assert len(double_newline) == 1
    assert smollm_tokenizer.encode("\n\n1.")[:1] == double_newline


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(smollm_tokenizer, smollm_hf_tokenizer, skip_special_tokens):
    sequences = [smollm_tokenizer.encode(text) for text in CORPUS]
    sequences.append([1, 9906, 2, 0, 30, 2])  # special tokens between ordinary ones
    sequences.append(list(range(0, 49152, 997)))  # a spread of arbitrary ids
    for ids in sequences:
        expected = smollm_hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert smollm_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_decode_round_trips_text(smollm_tokenizer):
    for text in CORPUS:
        assert smollm_tokenizer.decode(smollm_tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_accepts_any_int_sequence(smollm_tokenizer):
    import numpy as np

    ids = smollm_tokenizer.encode("Hello there")
    assert smollm_tokenizer.decode(tuple(ids)) == "Hello there"
    assert smollm_tokenizer.decode(np.array(ids, dtype=np.int64)) == "Hello there"


def test_attributes_match_transformers(smollm_tokenizer, smollm_hf_tokenizer, smollm_metadata):
    tok, hf = smollm_tokenizer, smollm_hf_tokenizer
    assert (tok.bos_token, tok.bos_token_id) == (hf.bos_token, hf.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 2)
    assert tok.add_bos_token is False
    assert tok.vocab_size == len(hf) == len(smollm_metadata["tokenizer.ggml.tokens"])
    assert tok.chat_template == smollm_metadata["tokenizer.chat_template"]
    control = {i for i, kind in enumerate(smollm_metadata["tokenizer.ggml.token_type"]) if kind == 3}
    assert tok.all_special_ids == frozenset(control)
    assert set(hf.all_special_ids) <= tok.all_special_ids
    for token_id in (0, 1, 17, 198, 9906, 49151):
        assert tok.id_to_token(token_id) == hf.convert_ids_to_tokens(token_id)
    assert tok.id_to_token(10**6) is None


def test_add_bos_token_from_metadata(smollm_metadata):
    tok = Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.add_bos_token": True})
    assert tok.add_bos_token is True
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == [tok.bos_token_id, *plain]
    assert tok.encode("") == [tok.bos_token_id]
    assert tok.encode_batch(["Hello"]) == [[tok.bos_token_id, *plain]]


def test_unknown_pre_tokenizer_warns_and_uses_gpt2_regex(smollm_metadata, smollm_hf_tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="roseinfer.tokenizer"):
        tok = Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.pre": "mystery-pre"})
    assert "mystery-pre" in caplog.text
    # The GPT-2 regex is what transformers' GGUF loader uses for this file, so all of it agrees.
    for text in CORPUS + DIGIT_AFTER_WHITESPACE:
        assert tok.encode(text) == hf_encode(smollm_hf_tokenizer, text), text


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("gpt2", "I'm 12345 cats", ["I", "'m", "Ġ12345", "Ġcats"]),
        ("default", "a  1", ["a", "Ġ", "Ġ1"]),
        ("smollm", "a  12", ["a", "ĠĠ", "1", "2"]),
        ("starcoder", "x=10", ["x", "=", "1", "0"]),
        ("llama-bpe", "I'M 12345 cats", ["I", "'M", "Ġ", "123", "45", "Ġcats"]),
        ("llama3", "hello\n\n  world", ["hello", "ĊĊ", "Ġ", "Ġworld"]),
        ("qwen2", "abc 123", ["abc", "Ġ", "1", "2", "3"]),
        ("deepseek-r1-qwen", "(x) 2024", ["(x", ")", "Ġ", "2", "0", "2", "4"]),
    ],
)
def test_pre_tokenizer_chosen_by_gguf_pre(smollm_metadata, pre, text, pieces):
    tok = Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.pre": pre})
    assert [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_unsupported_gguf_tokenizer_model(smollm_metadata):
    with pytest.raises(ModelLoadError, match="'rwkv'"):
        Tokenizer.from_gguf_metadata({**smollm_metadata, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


# -- GGUF: a sentencepiece ("llama") vocabulary -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_spm_hf(tiny_spm_gguf: Path):
    return transformers.AutoTokenizer.from_pretrained(tiny_spm_gguf.parent, gguf_file=tiny_spm_gguf.name)


def test_sentencepiece_gguf_matches_transformers(tiny_spm_tokenizer, tiny_spm_hf):
    tok, hf = tiny_spm_tokenizer, tiny_spm_hf
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, True)
    assert tok.all_special_ids == frozenset({0, 1, 2})
    texts = CORPUS + ["<s>hi</s>", " the lazy dog", "hello world hello"]
    for text in texts:
        for add_special in (True, False):
            assert tok.encode(text, add_special) == hf.encode(text, add_special_tokens=add_special), text
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
    # Characters outside the vocabulary fall back to their UTF-8 bytes, and come back whole.
    assert tok.id_to_token(tok.encode("漢", add_special_tokens=False)[-1]).startswith("<0x")
    assert tok.decode(tok.encode("漢字 😀")) == "漢字 😀"


def test_sentencepiece_without_scores_or_merges(tiny_spm_gguf):
    from roseinfer.models.gguf_file import GGUFFile

    metadata = dict(GGUFFile(tiny_spm_gguf).metadata)
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_gguf_metadata(metadata)


# -- Hugging Face directories -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_dir(smollm_hf_tokenizer, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf-tokenizer")
    smollm_hf_tokenizer.save_pretrained(path)
    return path


def assert_same_as(tok: Tokenizer, hf) -> None:
    for text in CORPUS + DIGIT_AFTER_WHITESPACE:
        for add_special in (True, False):
            assert tok.encode(text, add_special) == hf.encode(text, add_special_tokens=add_special), text
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.vocab_size == len(hf)


def test_from_pretrained_dir_matches_transformers(saved_dir):
    hf = transformers.AutoTokenizer.from_pretrained(saved_dir)
    tok = Tokenizer.from_pretrained_dir(saved_dir)
    assert_same_as(tok, hf)
    assert tok.chat_template == hf.chat_template
    assert tok.chat_template is not None
    assert tok.add_bos_token is False
    messages = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_tokenizer_json_decides_bos_like_transformers(saved_dir, tmp_path):
    # With a tokenizer.json, its post-processor decides; transformers ignores add_bos_token then.
    shutil.copy(saved_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((saved_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.add_bos_token is False
    assert_same_as(tok, hf)


def test_tokenizer_json_truncation_and_padding_are_dropped(saved_dir, tmp_path):
    backend = BackendTokenizer.from_file(str(saved_dir / "tokenizer.json"))
    backend.enable_truncation(4)
    backend.enable_padding(length=16)
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    text = "a prompt that is clearly longer than four tokens"
    assert tok.encode(text) == Tokenizer.from_pretrained_dir(saved_dir).encode(text)
    assert len(tok.encode(text)) > 4
    assert tok.encode("") == []


def test_chat_template_locations(saved_dir, tmp_path):
    template = (saved_dir / "chat_template.jinja").read_text()
    config = json.loads((saved_dir / "tokenizer_config.json").read_text())
    shutil.copy(saved_dir / "tokenizer.json", tmp_path / "tokenizer.json")

    # Inside tokenizer_config.json (older transformers), special tokens as {"content": ...} dicts.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        **config, "chat_template": template, "eos_token": {"content": "<|im_end|>", "special": True},
    }))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert (tok.chat_template, tok.eos_token, tok.eos_token_id) == (template, "<|im_end|>", 2)

    # Named templates: the "default" one.
    named = [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": template}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert Tokenizer.from_pretrained_dir(tmp_path).chat_template == template

    # A chat_template.json file wins over the config.
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ 'json' }}"}))
    assert Tokenizer.from_pretrained_dir(tmp_path).chat_template == "{{ 'json' }}"

    # And chat_template.jinja wins over both.
    (tmp_path / "chat_template.jinja").write_text("{{ 'jinja' }}")
    assert Tokenizer.from_pretrained_dir(tmp_path).chat_template == "{{ 'jinja' }}"

    # No template anywhere: apply_chat_template says so.
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / name).unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def write_vocab_merges_dir(tok: Tokenizer, path: Path, **config) -> None:
    """A GPT-2 style directory (vocab.json + merges.txt + tokenizer_config.json) from tok's BPE."""
    tok.backend.model.save(str(path))
    added = {
        str(i): {"content": t.content, "special": t.special, "normalized": False,
                 "lstrip": False, "rstrip": False, "single_word": False}
        for i, t in tok.backend.get_added_tokens_decoder().items()
    }
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "added_tokens_decoder": added, "chat_template": tok.chat_template,
        **config,
    }))


def test_gpt2_style_vocab_and_merges_dir(smollm_tokenizer, tmp_path):
    write_vocab_merges_dir(smollm_tokenizer, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert_same_as(tok, hf)
    assert tok.add_bos_token is False
    assert tok.chat_template == smollm_tokenizer.chat_template
    assert tok.all_special_ids == smollm_tokenizer.all_special_ids


def test_gpt2_style_dir_with_add_bos_token(smollm_tokenizer, tmp_path):
    write_vocab_merges_dir(smollm_tokenizer, tmp_path, add_bos_token=True)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.add_bos_token is True
    assert tok.encode("Hello") == [tok.bos_token_id, *tok.encode("Hello", add_special_tokens=False)]
    assert_same_as(tok, hf)


def test_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.from_pretrained_dir(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json.*vocab\.json \+ merges\.txt") as info:
        Tokenizer.from_pretrained_dir(tmp_path)
    assert str(tmp_path) in str(info.value)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)
