"""roseinfer.detokenizer: streamed deltas never split a character and add up to decode()."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.detokenizer import IncrementalDetokenizer
from roseinfer.tokenizer import Tokenizer

CORPUS = [
    "Hello, world! This is a plain ASCII sentence.",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧 ✨🦀",
    "漢字とひらがな。中文测试，한국어 텍스트",
    "Café déjà vu — naïve façade, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√",
    "def f(x):\n\treturn x ** 2  # 3.14159\n",
    "<|im_start|>assistant\nSure 🙂<|im_end|>\n",
    "   spaces   and\n\n\nnewlines   ",
    "",
]


def stream(tokenizer: Tokenizer, ids: Sequence[int], skip: bool = True, step: int = 1):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas = [detok.add_tokens(ids[i : i + step]) for i in range(0, len(ids), step)]
    return detok, deltas, detok.flush()


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("step", [1, 3])
def test_stream_equals_decode(smollm_tokenizer, skip, step):
    for text in CORPUS:
        ids = smollm_tokenizer.encode(text)
        detok, deltas, tail = stream(smollm_tokenizer, ids, skip, step)
        assert not any("\ufffd" in d for d in deltas), (text, deltas)
        assert "".join(deltas) + tail == smollm_tokenizer.decode(ids, skip_special_tokens=skip)
        assert detok.text == "".join(deltas) + tail
        assert detok.flush() == ""  # nothing left after the first flush


def test_multibyte_characters_are_held_back(smollm_tokenizer):
    # Each emoji is several byte-level tokens: the deltas in between are empty, never U+FFFD.
    ids = smollm_tokenizer.encode("👍🏽🦀")
    assert smollm_tokenizer.decode(ids[:1]).endswith("\ufffd")  # the test covers a split char
    _, deltas, tail = stream(smollm_tokenizer, ids)
    assert "" in deltas
    assert [d for d in deltas if d] == ["👍", "🏽", "🦀"]
    assert tail == ""


def test_special_tokens_in_the_stream(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hi") + [smollm_tokenizer.eos_token_id] + smollm_tokenizer.encode(" there")
    _, deltas, tail = stream(smollm_tokenizer, ids, skip=True)
    assert "".join(deltas) + tail == "Hi there"
    _, deltas, tail = stream(smollm_tokenizer, ids, skip=False)
    assert "".join(deltas) + tail == "Hi<|im_end|> there"


def test_generation_stopping_mid_character(smollm_tokenizer):
    ids = smollm_tokenizer.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte never arrives
    full = smollm_tokenizer.decode(cut)
    assert full.endswith("\ufffd")
    detok, deltas, tail = stream(smollm_tokenizer, cut)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == "ok"  # " " shares the token with the emoji's first bytes
    assert tail == " \ufffd"
    assert "".join(deltas) + tail == full
    assert detok.text == full


def test_decode_window_stays_small(smollm_tokenizer):
    """Each step decodes a few recent tokens, not the whole output."""
    windows: list[int] = []

    class RecordingTokenizer(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            windows.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = RecordingTokenizer(smollm_tokenizer.backend)
    ids = smollm_tokenizer.encode(" ".join(CORPUS) * 20)
    assert len(ids) > 1000
    _, deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == smollm_tokenizer.decode(ids)
    assert max(windows) <= 8
    assert len(windows) <= 2 * len(ids) + 2

    # Tokens that decode to nothing (skipped special tokens) do not widen the window either.
    windows.clear()
    ids = [smollm_tokenizer.eos_token_id] * 500 + smollm_tokenizer.encode("done 😀")
    _, deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == "done 😀"
    assert max(windows) <= 8


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60), step=st.integers(min_value=1, max_value=4))
def test_random_text_byte_level(smollm_tokenizer, text, step):
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    full = smollm_tokenizer.decode(ids)
    _, deltas, tail = stream(smollm_tokenizer, ids, step=step)
    assert "".join(deltas) + tail == full
    # U+FFFD may only appear where the text itself has one: a real U+FFFD, or bytes the
    # vocabulary lacks (SmolLM2 has no token for some rare lead bytes, e.g. of U+40000).
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_random_text_sentencepiece_byte_fallback(tiny_spm_tokenizer, text):
    ids = tiny_spm_tokenizer.encode(text)  # with BOS, as a prompt would be
    full = tiny_spm_tokenizer.decode(ids)
    _, deltas, tail = stream(tiny_spm_tokenizer, ids)
    assert "".join(deltas) + tail == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_stream(tiny_spm_tokenizer):
    for text in CORPUS + ["Hello world, hello there!", " the lazy dog"]:
        ids = tiny_spm_tokenizer.encode(text)
        for skip in (True, False):
            _, deltas, tail = stream(tiny_spm_tokenizer, ids, skip)
            assert not any("\ufffd" in d for d in deltas)
            assert "".join(deltas) + tail == tiny_spm_tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_ids(smollm_tokenizer, tiny_spm_tokenizer, data):
    """Arbitrary id sequences, including stray bytes and special tokens, as a bad model might emit."""
    for tok in (smollm_tokenizer, tiny_spm_tokenizer):
        # Mostly low ids: special tokens, single bytes and byte-fallback tokens live there.
        token_id = st.one_of(st.integers(0, 300), st.integers(0, tok.vocab_size - 1))
        ids = data.draw(st.lists(token_id, max_size=30))
        skip = data.draw(st.booleans())
        _, deltas, tail = stream(tok, ids, skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas)
        # Byte-level decoding is exact even for invalid UTF-8. Sentencepiece byte fallback turns a
        # whole run of byte tokens into U+FFFDs once the run is invalid, even bytes already
        # streamed, so there exactness needs valid output.
        if tok is smollm_tokenizer or "\ufffd" not in full:
            assert "".join(deltas) + tail == full


def test_sentencepiece_leading_space_after_a_textless_window(tiny_spm_tokenizer):
    """Sentencepiece decoders drop the leading space of the first piece they decode. A window that
    starts at a skipped special token, or at a lone '▁', gives no text of its own, so the next
    piece would be decoded as if it were first: its space must not be lost."""
    tok = tiny_spm_tokenizer
    word = next(i for i in range(tok.vocab_size) if tok.decode([3, i]).startswith("\x00 ") and len(tok.decode([i])) > 1)
    space = next(i for i in range(tok.vocab_size) if tok.decode([3, i]) == "\x00 ")
    special = tok.eos_token_id
    for ids in ([3, special, word], [3, space, word], [3, special, special, space, word], [3, space, space, word]):
        _, deltas, tail = stream(tok, ids, skip=True)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True), ids
