"""Hugging Face `config.json` -> ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.rotary import ROPE_SCALING_TYPES, rope_scaling_type, unsupported_rope_scaling

# model_type -> (our architecture, attention biases, q/k norms)
_LLAMA_FAMILY = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "phi3": (False, False),  # Phi-3, Phi-3.5, Phi-4-mini: fused checkpoint tensors (models/phi3.py)
}


def _eos_ids(*values: Any) -> list[int]:
    ids: list[int] = []
    for value in values:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None, float]:
    """rope_theta, scaling and partial_rotary_factor, from either the classic keys or transformers
    5's rope_parameters."""
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    partial = float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    scaling = raw.get("rope_scaling") or (params if rope_scaling_type(params) != "default" else None)
    if scaling is not None:
        kind = rope_scaling_type(scaling)
        if raw.get("model_type") == "phi3" and kind == "yarn":
            kind = "longrope"  # transformers reads Phi-3's old "yarn" configs as LongRoPE
        if kind not in ROPE_SCALING_TYPES:
            raise ModelLoadError(f"{path}: {unsupported_rope_scaling(kind)}")
        scaling = {**scaling, "rope_type": kind}
        # A top-level original_max_position_embeddings wins, as in transformers (Phi-3 keeps it
        # there, with 4096 as its default).
        original = raw.get("original_max_position_embeddings")
        if original is None and raw.get("model_type") == "phi3":
            original = 4096
        if kind in ("llama3", "yarn", "longrope") and original is not None:
            scaling["original_max_position_embeddings"] = original
    return theta, scaling, partial


def _stored_dtype(raw: dict[str, Any]) -> str | None:
    """The weights' dtype as config.json gives it (transformers 5 writes `dtype`, 4 `torch_dtype`)."""
    value = raw.get("dtype") or raw.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


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
    eos = _eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id"))
    name = directory.name

    if model_type in _LLAMA_FAMILY:
        default_bias, qk_norm = _LLAMA_FAMILY[model_type]
        heads = raw["num_attention_heads"]
        theta, scaling, partial_rotary = _rope(raw, path)
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        sliding = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        return ModelConfig(
            architecture="phi3" if model_type == "phi3" else "llama",
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", default_bias),
            qk_norm=qk_norm,
            hidden_act=raw.get("hidden_act", "silu"),
            sliding_window=sliding,
            rotary_dim=int(head_dim * partial_rotary) if partial_rotary != 1.0 else None,
            eos_token_ids=eos,
            name=name,
            checkpoint_dtype=_stored_dtype(raw),
        )
    if model_type == "gpt2":
        hidden = raw["n_embd"]
        activation = raw.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"{path}: GPT-2 activation {activation!r} is not supported")
        return ModelConfig(
            architecture="gpt2",
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["n_layer"],
            num_heads=raw["n_head"],
            num_kv_heads=raw["n_head"],
            head_dim=hidden // raw["n_head"],
            intermediate_size=raw.get("n_inner") or 4 * hidden,
            max_position_embeddings=raw.get("n_positions", 1024),
            norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=True,
            hidden_act=activation,
            eos_token_ids=eos,
            name=name,
            checkpoint_dtype=_stored_dtype(raw),
        )
    supported = sorted([*_LLAMA_FAMILY, "gpt2"])
    raise ModelLoadError(
        f"{path}: model_type {model_type!r} is not supported; supported: {supported}"
    )
