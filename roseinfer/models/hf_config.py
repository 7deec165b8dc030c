"""Hugging Face `config.json` -> ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from roseinfer.config import ModelConfig, MoeConfig
from roseinfer.errors import ModelLoadError

# model_type -> (our architecture, attention biases, q/k norms)
_LLAMA_FAMILY = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}

# Mixture-of-experts model_type -> (attention biases, per-head q/k norms, whole-q/k norms,
# renormalise the top-k router weights by default); see models/moe.py.
_MOE_FAMILY = {
    "mixtral": (False, False, False, True),
    "qwen2_moe": (True, False, False, False),
    "qwen3_moe": (False, True, False, False),
    "olmoe": (False, False, True, False),
}


def _eos_ids(*values: Any) -> list[int]:
    ids: list[int] = []
    for value in values:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and scaling, from either the classic keys or transformers 5's rope_parameters."""
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


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
        theta, scaling = _rope(raw)
        sliding = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            sliding = None
        return ModelConfig(
            architecture="llama",
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
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
            eos_token_ids=eos,
            name=name,
            checkpoint_dtype=_stored_dtype(raw),
        )
    if model_type in _MOE_FAMILY:
        return _moe_config(raw, model_type, path, eos, name)
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
    supported = sorted([*_LLAMA_FAMILY, *_MOE_FAMILY, "gpt2"])
    raise ModelLoadError(
        f"{path}: model_type {model_type!r} is not supported; supported: {supported}"
    )


def _moe_config(raw: dict[str, Any], model_type: str, path: Path, eos: list[int], name: str) -> ModelConfig:
    default_bias, qk_norm, qk_norm_full, default_norm_topk = _MOE_FAMILY[model_type]
    if raw.get("clip_qkv") is not None:
        raise ModelLoadError(f"{path}: OLMoE's clip_qkv={raw['clip_qkv']} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: expert activation {raw['hidden_act']!r} is not supported (silu only)")
    if raw.get("use_sliding_window") and model_type != "mixtral":
        raise ModelLoadError(f"{path}: use_sliding_window is not supported for {model_type}")
    num_layers = raw["num_hidden_layers"]
    num_experts = raw.get("num_local_experts") or raw["num_experts"]
    # Qwen-MoE: layers listed in mlp_only_layers, or off the decoder_sparse_step grid, are dense.
    step = raw.get("decoder_sparse_step") or 1
    dense = tuple(
        i for i in range(num_layers) if i in (raw.get("mlp_only_layers") or []) or (i + 1) % step
    )
    moe = MoeConfig(
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        norm_topk_prob=True if model_type == "mixtral" else bool(raw.get("norm_topk_prob", default_norm_topk)),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
        dense_layers=dense,
    )
    heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    return ModelConfig(
        architecture="moe",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("qkv_bias", raw.get("attention_bias", default_bias)),
        qk_norm=qk_norm,
        qk_norm_full=qk_norm_full,
        hidden_act=raw.get("hidden_act", "silu"),
        sliding_window=raw.get("sliding_window") if model_type == "mixtral" else None,
        eos_token_ids=eos,
        name=name,
        checkpoint_dtype=_stored_dtype(raw),
        moe=moe,
    )
