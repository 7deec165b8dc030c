"""The seed project's own GPT checkpoints: `torch.save({"model": state_dict, "config": {...}})`.

Its GPT is GPT-2 shaped (learned positions, LayerNorm, fused qkv with biases, exact GELU, tied
head), so it loads into our GPT-2 under Hugging Face names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from roseinfer.config import ModelConfig
from roseinfer.errors import ModelLoadError

_RENAMES = [  # (seed name pattern, Hugging Face GPT-2 name, stored as Conv1D [in, out])
    (r"token_embedding\.weight", "transformer.wte.weight", False),
    (r"position_embedding\.weight", "transformer.wpe.weight", False),
    (r"blocks\.(\d+)\.ln1\.(weight|bias)", r"transformer.h.\1.ln_1.\2", False),
    (r"blocks\.(\d+)\.ln2\.(weight|bias)", r"transformer.h.\1.ln_2.\2", False),
    (r"blocks\.(\d+)\.attn\.qkv_proj\.(weight|bias)", r"transformer.h.\1.attn.c_attn.\2", True),
    (r"blocks\.(\d+)\.attn\.out_proj\.(weight|bias)", r"transformer.h.\1.attn.c_proj.\2", True),
    (r"blocks\.(\d+)\.mlp\.fc1\.(weight|bias)", r"transformer.h.\1.mlp.c_fc.\2", True),
    (r"blocks\.(\d+)\.mlp\.fc2\.(weight|bias)", r"transformer.h.\1.mlp.c_proj.\2", True),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False),
]
_REQUIRED_CONFIG = ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_position_embeddings")


def load_seed_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a readable PyTorch checkpoint: {exc}") from exc
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise ModelLoadError(f"{path}: expected a dict with 'model' (state dict) and 'config' keys")
    raw = checkpoint.get("config") or {}
    missing = [k for k in _REQUIRED_CONFIG if k not in raw]
    if missing:
        raise ModelLoadError(f"{path}: the checkpoint's 'config' lacks {missing}")
    hidden, heads = int(raw["d_model"]), int(raw["n_heads"])
    config = ModelConfig(
        architecture="gpt2",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(raw["n_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(raw["d_ff"]),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="gelu",
        name=path.stem,
    )
    return config, checkpoint["model"]


def seed_weights(state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in state_dict.items():
        if name == "lm_head.weight":
            continue  # tied to the token embedding
        for pattern, replacement, conv1d in _RENAMES:
            if re.fullmatch(pattern, name):
                hf_name = re.sub(pattern, replacement, name)
                yield hf_name, tensor.t() if conv1d and hf_name.endswith("weight") else tensor
                break
        else:
            raise ModelLoadError(f"unexpected tensor {name!r} in the seed checkpoint")
