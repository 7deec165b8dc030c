"""What every family's config reader shares: a checkpoint's config (Hugging Face `config.json`, or
GGUF metadata) with the keys all families read alike, rotary scaling parsing and one builder of
the fields every `ModelConfig` has.

Each model class reads its own family's keys and defaults (`config_from_hf(source)` and
`config_from_gguf(source)` classmethods, found through models/registry.py by the checkpoint's
model_type or GGUF architecture); models/hf_config.py and models/gguf_loader.py open the files and
dispatch. This module knows no family, and imports no model (the model files import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roseinfer.config import ModelConfig, rope_scaling_type
from roseinfer.errors import ModelLoadError
from roseinfer.layers.rotary import ROPE_SCALING_TYPES, unsupported_rope_scaling
from roseinfer.models.gguf_file import GGUFFile


def eos_ids(*values: Any) -> list[int]:
    """The end-of-sequence ids of several sources (an id or a list of ids each), in order, once."""
    ids: list[int] = []
    for value in values:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def stored_dtype(raw: dict[str, Any]) -> str | None:
    """The weights' dtype as config.json gives it (transformers 5 writes `dtype`, 4 `torch_dtype`)."""
    value = raw.get("dtype") or raw.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


@dataclass(frozen=True)
class HFConfigSource:
    """A Hugging Face config.json (with generation_config.json's end-of-sequence ids), and the
    architecture name of the registry that its model_type maps to."""

    raw: dict[str, Any]
    path: Path
    architecture: str
    eos_token_ids: list[int]
    name: str

    @property
    def model_type(self) -> str:
        return self.raw.get("model_type", "")

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {message}")

    def rope(
        self, *, legacy_yarn_as: str | None = None, default_original_positions: int | None = None
    ) -> tuple[float, dict[str, Any] | None, float]:
        """rope_theta, scaling and partial_rotary_factor, from either the classic keys or
        transformers 5's rope_parameters; a scaling kind we do not compute is an error naming it.
        `legacy_yarn_as`: what an old "yarn" scaling means for this family (Phi-3: LongRoPE);
        `default_original_positions`: the family's original context where the config gives none."""
        raw = self.raw
        params = raw.get("rope_parameters") or {}
        theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
        partial = float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
        scaling = raw.get("rope_scaling") or (params if rope_scaling_type(params) != "default" else None)
        if scaling is not None:
            kind = rope_scaling_type(scaling)
            if kind == "yarn" and legacy_yarn_as:
                kind = legacy_yarn_as
            if kind not in ROPE_SCALING_TYPES:
                raise self.error(unsupported_rope_scaling(kind))
            scaling = {**scaling, "rope_type": kind}
            # A top-level original_max_position_embeddings wins, as in transformers.
            original = raw.get("original_max_position_embeddings")
            if original is None:
                original = default_original_positions
            if kind in ("llama3", "yarn", "longrope") and original is not None:
                scaling["original_max_position_embeddings"] = original
        return theta, scaling, partial

    def decoder_fields(self, *, max_positions: int = 2048, tied: bool = False) -> dict[str, Any]:
        """The sizes, norm epsilon and tying of a Llama-like decoder under transformers' usual
        keys; `max_positions` and `tied`: the family's defaults where the config says nothing."""
        raw = self.raw
        heads = raw["num_attention_heads"]
        return dict(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw.get("max_position_embeddings", max_positions),
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", tied),
        )

    def build(self, **fields: Any) -> ModelConfig:
        """The ModelConfig: `fields` (the family's reading) and what every checkpoint gives alike."""
        return ModelConfig(
            architecture=self.architecture, eos_token_ids=self.eos_token_ids, name=self.name,
            checkpoint_dtype=stored_dtype(self.raw), **fields,
        )


def _widest(value: Any) -> int:
    """A size GGUF gives for the whole model, or per layer (a list): the largest."""
    return max(int(item) for item in value) if isinstance(value, list) else int(value)


class GGUFConfigSource:
    """A GGUF file's metadata (keys under its general.architecture), and the architecture name of
    the registry that reads it."""

    def __init__(self, gguf: GGUFFile, architecture: str) -> None:
        self.gguf, self.architecture = gguf, architecture
        meta, arch = gguf.metadata, gguf.architecture
        tokens = meta.get("tokenizer.ggml.tokens") or []
        vocab_size = int(meta.get(f"{arch}.vocab_size") or len(tokens) or gguf.tensor_shape("token_embd.weight")[0])
        eos = [
            int(meta[k])
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if k in meta
        ]
        hidden, heads = int(self.key("embedding_length")), int(self.key("attention.head_count"))
        # The fields every GGUF file gives under the same keys (llama.cpp's converter writes them).
        self.common: dict[str, Any] = dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_layers=int(self.key("block_count")),
            num_heads=heads,
            # (a model whose every FFN is experts may not write it: Qwen3.5-MoE)
            # (Nemotron-H's converter writes one per layer, 0 for the layers without an MLP: the widest)
            intermediate_size=_widest(self.key("feed_forward_length", 0 if self.get("expert_count") else None)),
            max_position_embeddings=int(self.key("context_length")),
            tie_word_embeddings=not gguf.has_tensor("output.weight"),
            eos_token_ids=list(dict.fromkeys(eos)),
            name=str(meta.get("general.name") or gguf.path.stem),
        )

    @property
    def arch(self) -> str:
        """The file's own architecture name (general.architecture), the prefix of its keys."""
        return self.gguf.architecture

    @property
    def metadata(self) -> dict[str, Any]:
        return self.gguf.metadata

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.gguf.path}: {message}")

    def get(self, name: str, default: Any = None) -> Any:
        """`{arch}.{name}`, or `default` where the file does not have it."""
        return self.gguf.metadata.get(f"{self.arch}.{name}", default)

    def key(self, name: str, default: Any = None) -> Any:
        """`{arch}.{name}`, `default` where absent; a missing key without a default is an error."""
        value = self.get(name, default)
        if value is None:
            raise self.error(f"metadata key {self.arch}.{name} is missing")
        return value

    def head_dim(self) -> int:
        return int(self.get("attention.key_length") or self.common["hidden_size"] // self.common["num_heads"])

    def attention_fields(self) -> dict[str, Any]:
        """Key/value heads, head size and RMSNorm epsilon, under the keys every RMSNorm family has."""
        return dict(
            num_kv_heads=int(self.key("attention.head_count_kv", self.common["num_heads"])),
            head_dim=self.head_dim(),
            norm_eps=float(self.key("attention.layer_norm_rms_epsilon", 1e-6)),
        )

    def rope_scaling(self) -> dict[str, Any] | None:
        """The rotary scaling in transformers' terms (see layers/rotary.py), from the keys and
        tensors llama.cpp's converter writes; a kind we do not compute is an error naming it."""
        gguf = self.gguf
        kind = str(self.get("rope.scaling.type", "none")).lower()
        original = self.get("rope.scaling.original_context_length")
        if gguf.has_tensor("rope_freqs.weight"):  # Llama 3.1+: the llama3 scaling, as divisors
            return {"rope_type": "freq_factors", "factors": gguf.load_tensor("rope_freqs.weight").tolist()}
        if gguf.has_tensor("rope_factors_long.weight"):  # Phi-3: LongRoPE (the type key is not written)
            scaling = {
                "rope_type": "longrope",
                "long_factor": gguf.load_tensor("rope_factors_long.weight").tolist(),
                "short_factor": gguf.load_tensor("rope_factors_short.weight").tolist(),
                "original_max_position_embeddings": int(original or self.metadata[f"{self.arch}.context_length"]),
            }
            if self.get("rope.scaling.attn_factor") is not None:
                scaling["attention_factor"] = float(self.get("rope.scaling.attn_factor"))
            return scaling
        if kind == "none":
            return None
        factor = self.get("rope.scaling.factor")
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            for unsupported, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
                value = self.get(f"rope.scaling.{unsupported}")
                if value is not None and float(value) != neutral:
                    raise self.error(f"YaRN with rope.scaling.{unsupported} = {value} is not supported")
            scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
            # The converter writes these from the Hugging Face config when it sets them.
            for gguf_key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                                     ("yarn_beta_slow", "beta_slow")):
                if self.get(f"rope.scaling.{gguf_key}") is not None:
                    scaling[hf_key] = float(self.get(f"rope.scaling.{gguf_key}"))
            return scaling
        raise self.error(unsupported_rope_scaling(kind))

    def build(self, **fields: Any) -> ModelConfig:
        """The ModelConfig: `fields` (the family's reading) over the fields every file gives alike."""
        return ModelConfig(architecture=self.architecture, **{**self.common, **fields})
