"""Hugging Face `config.json` -> ModelConfig: the file opened, its model_type looked up in the
registry, and the model class of that family reading it (`config_from_hf`, in the model's own file;
the keys every family shares are in models/checkpoint_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

from roseinfer.config import ModelConfig, VisionConfig
from roseinfer.errors import ModelLoadError
from roseinfer.models.checkpoint_config import HFConfigSource, eos_ids
from roseinfer.models.registry import HF_MODEL_TYPES, model_class_for

# Vision-language checkpoints: model_type -> encoder family (models/vision); their text model is
# one of the text families, configured by `text_config`.
VISION_LANGUAGE_MODEL_TYPES = {"idefics3": "idefics3", "smolvlm": "idefics3"}
# Their weights: the text model's under this prefix (read as a text checkpoint's `model.`), the
# encoder's under the others.
VISION_TEXT_PREFIX = "model.text_model."
VISION_ENCODER_PREFIXES = ("model.vision_model.", "model.connector.")


def model_config_from_hf(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    generation = {}
    if (directory / "generation_config.json").is_file():
        generation = json.loads((directory / "generation_config.json").read_text())
    vision = None
    if raw.get("model_type") in VISION_LANGUAGE_MODEL_TYPES:  # the text model is read from its own part
        vision = VisionConfig(VISION_LANGUAGE_MODEL_TYPES[raw["model_type"]], raw)
        raw = {**raw["text_config"], "eos_token_id": raw.get("eos_token_id", raw["text_config"].get("eos_token_id"))}
        raw.setdefault("model_type", "llama")
    model_type = raw.get("model_type", "")
    architecture = HF_MODEL_TYPES.get(model_type)
    if architecture is None:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}")
    reader = getattr(model_class_for(architecture), "config_from_hf", None)
    if reader is None:
        raise ModelLoadError(f"{path}: model_type {model_type!r} ({architecture}) has no config reader here")
    eos = eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id"))
    config = reader(HFConfigSource(raw, path, architecture, eos, directory.name))
    config.vision = vision
    return config
