"""Hugging Face `config.json` -> ModelConfig: the file opened, its model_type looked up in the
registry, and the model class of that family reading it (`config_from_hf`, in the model's own file;
the keys every family shares are in models/checkpoint_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.models.checkpoint_config import HFConfigSource, eos_ids
from roseinfer.models.registry import HF_MODEL_TYPES, model_class_for


def model_config_from_hf(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    generation = {}
    if (directory / "generation_config.json").is_file():
        generation = json.loads((directory / "generation_config.json").read_text())
    model_type = raw.get("model_type", "")
    architecture = HF_MODEL_TYPES.get(model_type)
    if architecture is None:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}")
    reader = getattr(model_class_for(architecture), "config_from_hf", None)
    if reader is None:
        raise ModelLoadError(f"{path}: model_type {model_type!r} ({architecture}) has no config reader here")
    eos = eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id"))
    return reader(HFConfigSource(raw, path, architecture, eos, directory.name))
