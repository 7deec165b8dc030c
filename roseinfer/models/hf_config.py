"""Hugging Face `config.json` -> ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from roseinfer.config import ModelConfig, MoeConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.rotary import ROPE_SCALING_TYPES, rope_scaling_type, unsupported_rope_scaling
from roseinfer.models.registry import HF_MODEL_TYPES

# Which model_types each class reads, and our architecture name for them: the classes'
# hf_model_types (models/registry.py: HF_MODEL_TYPES). Here, each family's config defaults.

# Llama-family model_type -> (attention biases, q/k norms)
_LLAMA_FAMILY = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "phi3": (False, False),  # Phi-3, Phi-3.5, Phi-4-mini: fused checkpoint tensors (models/phi3.py)
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
    architecture = HF_MODEL_TYPES.get(model_type)
    if architecture is None:
        raise ModelLoadError(f"{path}: model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}")
    eos = _eos_ids(raw.get("eos_token_id"), generation.get("eos_token_id"))
    name = directory.name

    if model_type in _LLAMA_FAMILY:
        default_bias, qk_norm = _LLAMA_FAMILY[model_type]
        heads = raw["num_attention_heads"]
        theta, scaling, partial_rotary = _rope(raw, path)
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        sliding = raw.get("sliding_window")
        layer_types = raw.get("layer_types")
        if model_type == "qwen2":
            if not raw.get("use_sliding_window", False):
                sliding = None
            elif layer_types is None:  # as transformers: layers from max_window_layers on slide
                first = raw.get("max_window_layers", 28)
                layer_types = ["sliding_attention" if i >= first else "full_attention"
                               for i in range(raw["num_hidden_layers"])]
        return ModelConfig(
            architecture=architecture,
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
            layer_types=layer_types if sliding else None,
            rotary_dim=int(head_dim * partial_rotary) if partial_rotary != 1.0 else None,
            eos_token_ids=eos,
            name=name,
            checkpoint_dtype=_stored_dtype(raw),
        )
    if architecture in ("gemma2", "gemma3"):
        return _gemma_config(raw, model_type, architecture, path, eos, name)
    if architecture == "moe":
        return _moe_config(raw, model_type, path, eos, name)
    if architecture == "gpt2":
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
    raise ModelLoadError(f"{path}: model_type {model_type!r} ({architecture}) has no config reader here")


# Gemma model_type -> the period of its default layer pattern (every n-th layer global)
_GEMMA_PERIOD = {"gemma2": 2, "gemma3_text": 6}


def _gemma_config(
    raw: dict[str, Any], model_type: str, architecture: str, path: Path, eos: list[int], name: str
) -> ModelConfig:
    period = _GEMMA_PERIOD[model_type]
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: use_bidirectional_attention (an embedding model) is not supported")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{path}: Gemma activation {activation!r} is not supported (gelu_pytorch_tanh)")
    layers = raw["num_hidden_layers"]
    period = raw.get("sliding_window_pattern", period)
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)
    ]
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: rotary parameters per layer type
        global_rope, local_rope = params["full_attention"] or {}, params.get("sliding_attention") or {}
        theta = float(global_rope.get("rope_theta", 1_000_000.0))
        scaling = None
        if global_rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in global_rope.items() if k != "rope_theta"}
        local_theta = float(local_rope.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))
        if local_rope.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{path}: rotary scaling of the sliding layers is not supported")
    else:
        theta, scaling, _ = _rope(raw, path)  # Gemma: no partial rotary
        local_theta = float(raw.get("rope_local_base_freq", theta)) if model_type == "gemma3_text" else theta
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 8192),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        attention_bias=raw.get("attention_bias", False),
        qk_norm=architecture == "gemma3",
        hidden_act="gelu_pytorch_tanh",
        sliding_window=raw.get("sliding_window"),
        layer_types=layer_types,
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or head_dim),
        rope_local_theta=local_theta,
        norm_weight_offset=1.0,
        eos_token_ids=eos,
        name=name,
        checkpoint_dtype=_stored_dtype(raw),
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
    theta, scaling, _ = _rope(raw, path)
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
