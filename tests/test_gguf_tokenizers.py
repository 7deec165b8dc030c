"""Every kind of tokenizer a GGUF file carries, built from the file's own metadata
(roseinfer/gguf_tokenizer.py), against transformers loading the same file and the model's own
tokenizer.

Each vocabulary comes from a real tokenizer trained here in seconds: sentencepiece trains a
Gemma-style BPE (byte fallback, no prefix space, whitespace runs and <start_of_turn> as their own
pieces) and a T5-style Unigram, `tokenizers` a BERT WordPiece. The Gemma 3 and T5 files are written
by llama.cpp's own converter (tests/hf_to_gguf.py) from Hugging Face directories holding them;
the BERT file by gguf's writer the way that converter writes one (its converter names a
vocabulary by a hash of known tokenizers, which a freshly trained one is not).
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import shutil
import unicodedata
from pathlib import Path

import pytest
import torch
from hf_to_gguf import convert_hf_to_gguf, llama_cpp_chat_template
from support import CORPUS

from roseinfer.models.gguf_file import GGUFFile
from roseinfer.sampling_params import SamplingParams
from roseinfer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")

# Unicode, digits, whitespace runs and control characters, emoji (one a ZWJ sequence), empty text.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  indented   code\n\n\tx = 1\n",
    " leading space", "trailing space ", "", " ", "\n", "a\u00a0b\u3000c",
    "日本語のテキストも少し。中文测试，한국어",
    "emoji 🚀 and ✅ ok 😶\u200d🌫️ 👍🏽",
    "Numbers 3.14159 and 2024, 1000000 or 0xFF",
    "Café déjà vu, naïve façade. Ångström straße",
]
GEMMA_SPECIALS = ["<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", "<bos>x<eos><pad>"]
WHITESPACE_RUNS = ["Hello  world", "a   b    c     d", "x\n\ny\n\n\nz"]


def _training_text() -> list[str]:
    """Varied lines to train on: the test corpus, the texts above, and Python source (argparse's,
    fixed for a Python version) for a vocabulary of a realistic shape."""
    return CORPUS + TEXTS * 5 + inspect.getsource(argparse).splitlines()[:1500]


def _alone(path: Path, directory: Path) -> Path:
    """The GGUF in a directory of its own: transformers reads a directory's tokenizer files first."""
    directory.mkdir()
    return Path(shutil.copy(path, directory / path.name))


def _assert_same_as_transformers(ours: Tokenizer, hf, texts: list[str]) -> None:
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf(text, add_special_tokens=special).input_ids, (
                text, special,
            )
        ids = hf(text).input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


# -- Gemma: sentencepiece BPE as a Gemma GGUF spells it ------------------------------------------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Gemma 3 with a Gemma-style sentencepiece tokenizer, as a Hugging Face directory
    and as the GGUF llama.cpp's converter makes of it (alone in its directory)."""
    root = tmp_path_factory.mktemp("gemma3-spm")
    hf = root / "hf"
    hf.mkdir()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_text()), model_writer=model, vocab_size=600, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True,
        normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", minloglevel=2,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "▁▁", "▁▁▁", "▁▁▁▁", "\n\n"],
    )
    (hf / "tokenizer.model").write_bytes(model.getvalue())
    # As Gemma's own tokenizer_config: the turn markers special, the whitespace runs not.
    processor = sentencepiece.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    added = {
        str(i): {"content": processor.id_to_piece(i), "lstrip": False, "rstrip": False, "normalized": False,
                 "single_word": False, "special": i < 6}
        for i in range(10)
    }
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "tokenizer_class": "GemmaTokenizer",
        "chat_template": llama_cpp_chat_template("google-gemma-2-2b-it"),
    }))
    config = transformers.Gemma3TextConfig(
        vocab_size=processor.get_piece_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, sliding_window=12,
        eos_token_id=1, bos_token_id=2, pad_token_id=0,
        # Gemma 3's own head size and query scale: a GGUF carries no query scale, and transformers
        # loading one takes 256 (llama.cpp takes the head size).
        head_dim=256, query_pre_attn_scalar=256,
    )
    config.initializer_range = 0.1
    config.tie_word_embeddings = False  # tied, a random model echoes the prompt's last token
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, parameter in reference.named_parameters():  # Gemma initialises its norms to 0 (scale 1)
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(parameter, 0.0, 0.3)
    reference.save_pretrained(hf)
    gguf = _alone(convert_hf_to_gguf(hf, root / "gemma3.gguf"), root / "gguf")
    return {"hf": hf, "gguf": gguf}


@pytest.fixture(scope="module")
def gemma3_hf_tokenizer(gemma3):
    return transformers.AutoTokenizer.from_pretrained(gemma3["gguf"].parent, gguf_file=gemma3["gguf"].name)


def test_gemma_gguf_is_spelled_as_published_files_are(gemma3):
    """What the converter wrote is the shape that made Gemma files fail before: 'llama' model of a
    gemma architecture, whitespace runs in real spaces (user-defined), no merges, no space prefix."""
    metadata = GGUFFile(gemma3["gguf"]).metadata
    assert (metadata["general.architecture"], metadata["tokenizer.ggml.model"]) == ("gemma3", "llama")
    assert "tokenizer.ggml.merges" not in metadata and metadata["tokenizer.ggml.add_space_prefix"] is False
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    assert [(tokens[i], types[i]) for i in (4, 6, 9)] == [("<start_of_turn>", 3), ("  ", 4), ("\n\n", 4)]


def test_gemma_sentencepiece_gguf_matches_transformers(gemma3, gemma3_hf_tokenizer):
    ours = Tokenizer.from_gguf_metadata(GGUFFile(gemma3["gguf"]).metadata)
    assert (ours.bos_token, ours.eos_token, ours.add_bos_token) == ("<bos>", "<eos>", True)
    _assert_same_as_transformers(ours, gemma3_hf_tokenizer, TEXTS + GEMMA_SPECIALS + WHITESPACE_RUNS)
    assert {0, 1, 2, 4, 5} <= ours.skipped_ids  # control tokens: whole in text, dropped by decode
    # The chat template travels in the file, rendered with the file's tokens.
    rendered = ours.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == gemma3_hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )


def test_gemma_sentencepiece_gguf_matches_sentencepiece_itself(gemma3):
    """And the model's own tokenizer.model: the same pieces for text without special markup. (Not
    for runs of four or more spaces: sentencepiece takes its longest whitespace piece first, the
    merges rebuilt from the file, ours and transformers' alike, pair them differently.)"""
    ours = Tokenizer.from_gguf_metadata(GGUFFile(gemma3["gguf"]).metadata)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(gemma3["hf"] / "tokenizer.model"))
    for text in TEXTS + ["Hello  world", "x\n\ny\n\n\nz", "<start_of_turn>user\nHi<end_of_turn>"]:
        assert ours.encode(text, add_special_tokens=False) == processor.encode(text), text


def test_gemma3_gguf_runs_with_no_tokenizer_flag_as_transformers(gemma3, gemma3_hf_tokenizer):
    """The issue's target: the file alone, no --tokenizer, text prompts; the prompt ids and 16
    greedy tokens equal transformers' loading the same file (--quantization none)."""
    from roseinfer import LLM

    prompts = [
        "Hello  world, 🚀 ok",
        "<start_of_turn>user\nThe quick brown fox<end_of_turn>\n<start_of_turn>model\n",
        "  indented   code\n\n\tx = 1",
    ]
    llm = LLM(str(gemma3["gguf"]), num_kv_blocks=64, quantization="none")
    outputs = llm.generate(
        prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gemma3["gguf"].parent, gguf_file=gemma3["gguf"].name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    reference.generation_config.eos_token_id = None
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = gemma3_hf_tokenizer(prompt).input_ids
        assert list(output.prompt_token_ids) == ids, prompt
        with torch.no_grad():
            greedy = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert list(output.outputs[0].token_ids) == greedy[0, len(ids):].tolist(), prompt
        assert output.outputs[0].text == gemma3_hf_tokenizer.decode(greedy[0, len(ids):], skip_special_tokens=True)


def _write_tokenizer_gguf(
    path: Path, arch: str, model: str, tokens: list[str], types: list[int], *, scores: list[float] | None = None,
    merges: list[str] | None = None, ids: dict[str, int] | None = None, flags: dict[str, bool] | None = None,
    chat_template: str | None = None, pre: str | None = None,
) -> Path:
    """A metadata-only GGUF holding a tokenizer, under llama.cpp's keys (gguf's own writer)."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    for name, value in (ids or {}).items():  # bos, eos, unk, pad, sep, mask
        getattr(writer, f"add_{name}_token_id")(value)
    for name, value in (flags or {}).items():  # add_bos_token, add_eos_token, add_sep_token, add_space_prefix
        getattr(writer, f"add_{name}")(value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gemma4_tokenizer_model_matches_transformers(gemma3, gemma3_hf_tokenizer, tmp_path):
    """tokenizer.ggml.model = "gemma4": the vocabulary spelled as tokenizer.json spells it ("▁▁"),
    the merges listed, BOS asked for by the file but added by the chat template (as transformers)."""
    metadata = GGUFFile(gemma3["gguf"]).metadata
    backend = json.loads(gemma3_hf_tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [""] * len(backend["vocab"])
    for token, i in backend["vocab"].items():
        tokens[i] = token
    path = _write_tokenizer_gguf(
        tmp_path / "gemma4" / "gemma4.gguf", "gemma4", "gemma4", tokens, metadata["tokenizer.ggml.token_type"],
        scores=metadata["tokenizer.ggml.scores"], merges=[" ".join(pair) for pair in backend["merges"]],
        ids={"bos": 2, "eos": 1, "pad": 0}, flags={"add_bos_token": True, "add_space_prefix": False},
    )
    ours = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.add_bos_token is False
    _assert_same_as_transformers(ours, hf, TEXTS + GEMMA_SPECIALS + WHITESPACE_RUNS)


# -- Phi-3: sentencepiece with the prefix "▁" always prepended -----------------------------------------


def test_phi3_sentencepiece_matches_transformers(tiny_spm_gguf, tmp_path):
    metadata = GGUFFile(tiny_spm_gguf).metadata
    path = _write_tokenizer_gguf(
        tmp_path / "phi3" / "phi3.gguf", "phi3", "llama", metadata["tokenizer.ggml.tokens"],
        metadata["tokenizer.ggml.token_type"], scores=metadata["tokenizer.ggml.scores"],
        ids={"bos": 1, "eos": 2, "unk": 0}, flags={"add_bos_token": True},
    )
    ours = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # "  hi": three "▁" here, two with the Llama pipeline (which the plain "llama" file keeps).
    texts = [*TEXTS, "  hi", " the lazy dog", "<s>hi</s>"]
    _assert_same_as_transformers(ours, hf, texts)
    llama = Tokenizer.from_gguf_metadata(metadata)
    assert ours.encode("  hi") != llama.encode("  hi") and ours.encode("hi") == llama.encode("hi")


# -- T5: sentencepiece Unigram -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> dict[str, Path]:
    """A tiny random T5 with a trained Unigram spiece.model (sentencepiece's default NFKC map), and
    the GGUF llama.cpp's converter makes of it: 500 ids, the ones past the vocabulary `[PADn]`."""
    pytest.importorskip("google.protobuf")  # the converter reads the model's normalizer spec with it
    root = tmp_path_factory.mktemp("t5")
    hf = root / "hf"
    hf.mkdir()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_text()), model_writer=model, vocab_size=380, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2,
    )
    (hf / "spiece.model").write_bytes(model.getvalue())
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer", "extra_ids": 100, "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>",
    }))
    config = transformers.T5Config(
        vocab_size=500, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    transformers.T5ForConditionalGeneration(config).save_pretrained(hf)
    gguf = _alone(convert_hf_to_gguf(hf, root / "t5.gguf"), root / "gguf")
    return {"hf": hf, "gguf": gguf}


T5_TEXTS = [*TEXTS, "Hello  world\n\nnext   line", "<extra_id_0> a blank <extra_id_1>", "</s>x<pad>", "tab\there"]
# Text the model's character map rewrites (NFKC: full-width forms, ligatures, circled digits).
T5_NORMALIZED = ["ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３", "ﬁne ﬂour", "① ② ③"]


def test_t5_unigram_gguf_matches_the_models_own_tokenizer(t5):
    """Against T5Tokenizer on the spiece.model itself, including text the file's precompiled
    character map normalizes (llama.cpp applies it too)."""
    ours = Tokenizer.from_gguf_metadata(GGUFFile(t5["gguf"]).metadata)
    reference = transformers.AutoTokenizer.from_pretrained(t5["hf"])
    assert (ours.eos_token, ours.add_bos_token) == ("</s>", False)
    for text in T5_TEXTS + T5_NORMALIZED:
        ids = reference(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


def test_t5_unigram_gguf_matches_transformers_on_the_same_file(t5):
    """transformers' GGUF loader leaves the character map out: the same ids wherever the map
    changes nothing (NFKC leaves the text as it is), and ours are the model's own where it does."""
    ours = Tokenizer.from_gguf_metadata(GGUFFile(t5["gguf"]).metadata)
    hf = transformers.AutoTokenizer.from_pretrained(t5["gguf"].parent, gguf_file=t5["gguf"].name)
    unchanged = [text for text in T5_TEXTS if unicodedata.normalize("NFKC", text) == text]
    assert len(unchanged) >= len(T5_TEXTS) - 2
    _assert_same_as_transformers(ours, hf, unchanged)
    assert ours.encode(T5_NORMALIZED[0]) != hf(T5_NORMALIZED[0]).input_ids


# -- BERT: WordPiece -----------------------------------------------------------------------------------


def test_bert_wordpiece_gguf_matches_bert_tokenizer(tmp_path):
    """transformers has no GGUF loader for WordPiece: the reference is BertTokenizer on the vocabulary
    the file was made from. The file is respelled as llama.cpp's converter does (conversion/bert.py):
    word-initial pieces get "▁", "##" continuations lose it, [CLS] is BOS and [SEP] the separator."""
    from tokenizers.implementations import BertWordPieceTokenizer

    trained = BertWordPieceTokenizer(lowercase=True)
    trained.train_from_iterator(_training_text(), vocab_size=600, show_progress=False)
    hf_dir = tmp_path / "bert"
    hf_dir.mkdir()
    trained.save_model(str(hf_dir))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir)

    vocab = (hf_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    control = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    types = [3 if piece in control else 1 for piece in vocab]
    tokens = [
        piece if kind == 3 else piece[2:] if piece.startswith("##") else "▁" + piece
        for piece, kind in zip(vocab, types, strict=True)
    ]
    ids = {name: vocab.index(f"[{name.upper()}]") for name in ("unk", "pad", "sep", "mask")}
    ids |= {"bos": vocab.index("[CLS]"), "eos": vocab.index("[SEP]")}
    path = _write_tokenizer_gguf(
        tmp_path / "gguf" / "bert.gguf", "bert", "bert", tokens, types, ids=ids,
        flags={"add_bos_token": True, "add_eos_token": False, "add_sep_token": True},
    )
    ours = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    assert (ours.bos_token, ours.eos_token) == ("[CLS]", "[SEP]")
    for text in [*TEXTS, "Hello  WORLD\n\nnext line", "unseenword xyzzy", "[CLS] x [SEP]", "a-b_c.d", "MiXeD CaSe"]:
        for special in (True, False):
            expected = reference(text, add_special_tokens=special).input_ids
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        ids_ = reference(text).input_ids
        assert ours.decode(ids_) == reference.decode(ids_, skip_special_tokens=True), text


# -- byte-level BPE: each family's split (Qwen2, Llama 3, GPT-4o / gpt-oss) -------------------------------

BPE_TEXTS = [
    *TEXTS, "I'M sure they'll say it's fine, WON'T they?", "12345678 x  2 (x) 2024\n\n\n  end",
    "ΑΒΓ αβγ Ǆǅǆ camelCaseWord HTTPServer", "a/b/c\r\n\r\nd", "<|im_start|>user\nHi<|im_end|>",
]


# Three of the splits (each ~9 s: a 49k vocabulary written and read by transformers); Qwen3.5's and
# Tekken's differ from Qwen2's and GPT-4o's in one character class each.
@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-4o"])
def test_byte_level_pre_tokenizers_match_transformers(smollm_metadata, tmp_path, pre):
    """A real BPE vocabulary (the default model's) under each family's `tokenizer.ggml.pre`: the ids
    transformers gives loading the same file, which splits text with the same family regexes."""
    path = _write_tokenizer_gguf(
        tmp_path / pre / "bpe.gguf", "qwen2", "gpt2", smollm_metadata["tokenizer.ggml.tokens"],
        smollm_metadata["tokenizer.ggml.token_type"], merges=smollm_metadata["tokenizer.ggml.merges"],
        ids={"bos": smollm_metadata["tokenizer.ggml.bos_token_id"], "eos": smollm_metadata["tokenizer.ggml.eos_token_id"]},
        flags={"add_bos_token": False}, pre=pre,
    )
    metadata = GGUFFile(path).metadata
    assert metadata.get("tokenizer.ggml.pre") == pre
    ours = Tokenizer.from_gguf_metadata(metadata)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _assert_same_as_transformers(ours, hf, BPE_TEXTS)
