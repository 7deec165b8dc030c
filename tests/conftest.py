"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# The suite's references are float32 computations on the CPU: on a GPU machine `--device auto` (and
# every engine and server the tests start without a device) stays on the CPU, and only the tests
# that ask for CUDA by name (test_cuda.py) use the GPU. roseinfer.config.DEVICE_ENV; subprocesses
# inherit it.
os.environ.setdefault("ROSEINFER_DEVICE", "cpu")


@pytest.fixture(scope="session")
def kernels():
    """roseinfer's compiled CPU kernels; tests that take them skip where they cannot be built."""
    from roseinfer.layers.cpu_kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        pytest.skip("the C++ kernels cannot be built on this machine (no compiler)")
    return module


# ---------------------------------------------------------------------------------------------
# Tokenizer fixtures (tests/test_tokenizer.py, test_chat_template.py, test_detokenizer.py).
# Session-scoped: reading the GGUF and building transformers' reference tokenizer take seconds.
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm_gguf_path() -> Path:
    from roseinfer.errors import ModelLoadError
    from roseinfer.models.default_model import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm_metadata(smollm_gguf_path: Path) -> dict[str, Any]:
    from roseinfer.models.gguf_file import GGUFFile

    return GGUFFile(smollm_gguf_path).metadata


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_metadata: dict[str, Any]):
    from roseinfer.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(smollm_metadata)


@pytest.fixture(scope="session")
def smollm_hf_tokenizer(smollm_gguf_path: Path):
    """transformers' tokenizer for the same GGUF: the reference. Do not modify it in tests."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_gguf_path.parent, gguf_file=smollm_gguf_path.name)


SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Café déjà vu, naïve façade.",
    "def main():\n    return 42\n",
    "In 2024 there were 3.14159 apples and 1000 pears.",
] * 30


@pytest.fixture(scope="session")
def tiny_spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A metadata-only GGUF with a small llama.cpp-style sentencepiece ("llama") vocabulary:
    <unk>/<s>/</s>, 256 byte-fallback tokens, then BPE pieces scored by merge rank."""
    import json

    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(SPM_CORPUS, trainers.BpeTrainer(vocab_size=320, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    merged = ["".join(pair) for pair in model["merges"]]
    alphabet = [t for t in model["vocab"] if t not in set(merged)]

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + merged + alphabet
    types = [2, 3, 3] + [6] * 256 + [1] * (len(merged) + len(alphabet))
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged))]
    scores += [-1000.0 - i for i in range(len(alphabet))]

    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_spm_tokenizer(tiny_spm_gguf: Path):
    from roseinfer.models.gguf_file import GGUFFile
    from roseinfer.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(GGUFFile(tiny_spm_gguf).metadata)


# ------------------------------------------------------------------ end of tokenizer fixtures --
