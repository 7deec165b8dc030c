"""llama.cpp's own `convert_hf_to_gguf.py`, the converter users run on a Hugging Face directory.

The script ships in the llama-cpp-python source distribution on PyPI (with its `conversion`
package and the `gguf-py` it is written against); it is fetched once with pip into a cache beside
the virtual environment and run in a subprocess, exactly as a user would run it.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# "-2": the extraction now holds the chat templates too (one download serves both).
_CACHE = Path(sys.prefix) / f".llama-cpp-convert-{LLAMA_CPP_PYTHON_VERSION}-2"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")


def converter_dir() -> Path:
    """The directory holding `convert_hf_to_gguf.py` (and llama.cpp's chat templates), fetched on
    first use (~80 MB download)."""
    ready = _CACHE / "ready"
    if ready.exists():
        return _CACHE / "llama.cpp"
    _CACHE.mkdir(parents=True, exist_ok=True)
    with open(_CACHE / "lock", "w") as lock:  # pytest-xdist or two sessions: one download
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                 f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(_CACHE)],
                check=True,
            )
            archive = _CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
            prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
            with tarfile.open(archive) as tar:
                members = []
                for member in tar.getmembers():
                    inner = member.name.removeprefix(prefix)
                    if member.name.startswith(prefix) and inner.startswith(_WANTED) and member.isfile():
                        member.name = "llama.cpp/" + inner
                        members.append(member)
                tar.extractall(_CACHE, members=members, filter="data")
            archive.unlink()
            ready.touch()
    return _CACHE / "llama.cpp"


def llama_cpp_chat_template(name: str) -> str:
    """A real model's chat template from llama.cpp's collection (`models/templates/<name>.jinja` in
    the same source distribution, extracted with the converter)."""
    return (converter_dir() / "models" / "templates" / f"{name}.jinja").read_text()


def write_default_tokenizer(path: Path) -> int:
    """The default model's (SmolLM2's) tokenizer files into `path`; returns its vocabulary size.

    The converter names a BPE pre-tokenizer by the hash of how it splits a fixed text and refuses
    ones it does not know, so a freshly trained tiny BPE cannot go through it: tiny random models
    meant for the converter borrow this real, recognised tokenizer instead."""
    from roseinfer.models.default_model import default_model_path
    from roseinfer.models.export import write_hf_tokenizer
    from roseinfer.models.gguf_file import GGUFFile
    from roseinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    path.mkdir(parents=True, exist_ok=True)
    write_hf_tokenizer(tokenizer, 8192, path)
    return tokenizer.backend.get_vocab_size()


def convert_hf_to_gguf(hf_dir: Path, output: Path, outtype: str = "f32", *options: str) -> Path:
    """Convert a Hugging Face model directory to a GGUF file with llama.cpp's converter (`options`:
    more of its command line, e.g. --no-mtp for a Qwen3.5 built without its MTP layers)."""
    root = converter_dir()
    env = os.environ | {"PYTHONPATH": str(root / "gguf-py"), "NO_LOCAL_GGUF": ""}
    result = subprocess.run(
        [sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(output),
         "--outtype", outtype, *options],
        env=env, capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{result.stderr[-4000:]}")
    return output
