"""GGUF (llama.cpp's format) -> ModelConfig and Hugging Face-named checkpoint tensors: dense ones
as torch tensors, quantized ones as `BlockTensor`s in their own type (or expanded to float32 for
tools that want plain values).

llama.cpp's converter permutes the rows of Llama q/k weights for its interleaved rotary layout;
we undo that so one model implementation serves GGUF and Hugging Face checkpoints alike (on
blocks, a permutation of whole rows; the model's own re-interleaving then undoes it for free).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from roseinfer.config import ModelConfig, MoeConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.quantization import permute_rows
from roseinfer.layers.quantization.gguf import BlockTensor
from roseinfer.layers.rotary import unsupported_rope_scaling
from roseinfer.models.gguf_file import GGUFFile
from roseinfer.models.registry import GGUF_ARCHITECTURES, model_class_for

# Gemma: arch -> the period of llama.cpp's layer pattern (every n-th layer global), which the
# converter does not write (llama.cpp hard-codes it), and the layer count of the 27B model, whose
# queries llama.cpp scales by (hidden / heads) ** -0.5 (its query_pre_attn_scalar) instead of
# head_dim ** -0.5.
GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}
_ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_PERMUTED_QK = ("llama", "mistral")  # the converter's convention for these files' q/k rows
# Tensor names: each model class's gguf_layer_names / gguf_global_names (models/llama.py, ...).


def unpermute_qk(weight: torch.Tensor | BlockTensor, num_heads: int) -> torch.Tensor | BlockTensor:
    """Inverse of llama.cpp's row permutation of q/k (interleaved pairs -> rotate-half halves)."""

    def unpermute(rows: torch.Tensor) -> torch.Tensor:
        half = rows.shape[0] // num_heads // 2
        return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)

    return permute_rows(weight, unpermute)


def model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    meta = gguf.metadata
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{gguf.path}: metadata key {arch}.{name} is missing")
        return value

    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab_size = int(meta.get(f"{arch}.vocab_size") or len(tokens) or gguf.tensor_shape("token_embd.weight")[0])
    eos = [
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in meta
    ]
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=int(key("block_count")),
        num_heads=heads,
        intermediate_size=int(key("feed_forward_length")),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings=not gguf.has_tensor("output.weight"),
        eos_token_ids=list(dict.fromkeys(eos)),
        name=str(meta.get("general.name") or gguf.path.stem),
    )
    architecture = GGUF_ARCHITECTURES[arch]
    if architecture == "gpt2":
        return ModelConfig(
            architecture="gpt2",
            num_kv_heads=heads,
            head_dim=hidden // heads,
            norm_eps=float(key("attention.layer_norm_epsilon", 1e-5)),
            hidden_act="gelu_new",
            **common,
        )
    if arch in GEMMA:
        return _gemma_config(gguf, arch, key, common)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rotary_dim = meta.get(f"{arch}.rope.dimension_count")
    return _with_experts(gguf, ModelConfig(
        architecture=architecture,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gguf),
        rotary_dim=int(rotary_dim) if rotary_dim is not None and int(rotary_dim) != head_dim else None,
        attention_bias=gguf.has_tensor("blk.0.attn_q.bias"),
        qk_norm=gguf.has_tensor("blk.0.attn_q_norm.weight"),
        # Phi-3's converter writes 0 for "none" (Phi-4).
        sliding_window=meta.get(f"{arch}.attention.sliding_window") or None,
        **common,
    ))


def _with_experts(gguf: GGUFFile, config: ModelConfig) -> ModelConfig:
    """A mixture-of-experts file's config (architecture "moe"), or `config` where it has no experts."""
    arch, meta = gguf.architecture, gguf.metadata
    num_experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not num_experts:
        if config.architecture == "moe":
            raise ModelLoadError(f"{gguf.path}: metadata key {arch}.expert_count is missing")
        return config
    if f"{arch}.expert_used_count" not in meta:
        raise ModelLoadError(f"{gguf.path}: metadata key {arch}.expert_used_count is missing")
    # llama.cpp's own choices where the file does not say: Mixtral and Qwen3-MoE renormalise the
    # chosen experts' weights, Qwen2-MoE and OLMoE do not.
    norm_topk = meta.get(f"{arch}.expert_weights_norm", arch in ("llama", "qwen3moe"))
    shared = 0
    if gguf.has_tensor("blk.0.ffn_up_shexp.weight"):
        shared = gguf.tensor_shape("blk.0.ffn_up_shexp.weight")[0]
    # OLMoE normalises the whole of q and of k (a norm of q's width), Qwen3-MoE each head.
    full_qk_norm = config.qk_norm and gguf.tensor_shape("blk.0.attn_q_norm.weight")[0] != config.head_dim
    moe = MoeConfig(
        num_experts=num_experts,
        top_k=int(meta[f"{arch}.expert_used_count"]),
        intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length") or config.intermediate_size),
        norm_topk_prob=bool(norm_topk),
        shared_expert_intermediate_size=shared,
        dense_layers=tuple(i for i in range(config.num_layers) if not gguf.has_tensor(f"blk.{i}.ffn_gate_inp.weight")),
    )
    return dataclasses.replace(
        config, architecture="moe", moe=moe, qk_norm=config.qk_norm and not full_qk_norm, qk_norm_full=full_qk_norm
    )


def _expert_slices(
    tensor: torch.Tensor | BlockTensor, shape: tuple[int, ...], layer: str, projections: tuple[str, ...]
) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
    """A 3-D [experts, rows, columns] expert tensor as one tensor per expert (and projection, for a
    fused gate/up), under Hugging Face names: views of the same bytes, blocks kept as they are."""
    num_experts, rows = shape[0], shape[1]
    part_rows = rows // len(projections)
    for expert in range(num_experts):
        for index, projection in enumerate(projections):
            start = expert * rows + index * part_rows
            if isinstance(tensor, BlockTensor):
                part = tensor.narrow(0, start, part_rows)
            else:
                part = tensor.reshape(num_experts * rows, -1)[start:start + part_rows]
            yield f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight", part


def _gemma_config(gguf: GGUFFile, arch: str, key, common: dict) -> ModelConfig:
    meta = gguf.metadata
    period, layers_27b = GEMMA[arch]
    layers = common["num_layers"]
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: whether it slides
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        period = int(pattern or period)
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    heads = common["num_heads"]
    head_dim = int(meta.get(f"{arch}.attention.key_length") or common["hidden_size"] // heads)
    if f"{arch}.attention.scale" in meta:
        scalar = float(meta[f"{arch}.attention.scale"]) ** -2
    else:
        scalar = common["hidden_size"] / heads if layers == layers_27b else head_dim
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{gguf.path}: rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported")
    theta = float(key("rope.freq_base", 10000.0 if arch == "gemma2" else 1_000_000.0))
    return ModelConfig(
        architecture=arch,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=arch == "gemma3",
        hidden_act="gelu_pytorch_tanh",
        sliding_window=int(window) if window else None,
        layer_types=layer_types if window else None,
        attn_logit_softcapping=meta.get(f"{arch}.attn_logit_softcapping"),
        final_logit_softcapping=meta.get(f"{arch}.final_logit_softcapping"),
        query_pre_attn_scalar=float(scalar),
        rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0 if arch == "gemma3" else theta)),
        norm_weight_offset=0.0,  # the converter stored 1 + w
        **common,
    )


def _rope_scaling(gguf: GGUFFile) -> dict | None:
    """The rotary scaling in transformers' terms (see layers/rotary.py), from the GGUF keys and
    tensors llama.cpp's converter writes; a kind we do not compute is an error naming it."""
    meta, arch = gguf.metadata, gguf.architecture
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none")).lower()
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if gguf.has_tensor("rope_freqs.weight"):  # Llama 3.1+: the llama3 scaling, as divisors
        return {"rope_type": "freq_factors", "factors": gguf.load_tensor("rope_freqs.weight").tolist()}
    if gguf.has_tensor("rope_factors_long.weight"):  # Phi-3: LongRoPE (the type key is not written)
        scaling = {
            "rope_type": "longrope",
            "long_factor": gguf.load_tensor("rope_factors_long.weight").tolist(),
            "short_factor": gguf.load_tensor("rope_factors_short.weight").tolist(),
            "original_max_position_embeddings": int(original or meta[f"{arch}.context_length"]),
        }
        if f"{arch}.rope.scaling.attn_factor" in meta:
            scaling["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"])
        return scaling
    if kind == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        for unsupported, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            value = meta.get(f"{arch}.rope.scaling.{unsupported}")
            if value is not None and float(value) != neutral:
                raise ModelLoadError(f"{gguf.path}: YaRN with rope.scaling.{unsupported} = {value} is not supported")
        scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
        # The converter writes these from the Hugging Face config when it sets them.
        for gguf_key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                                 ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{gguf_key}" in meta:
                scaling[hf_key] = float(meta[f"{arch}.rope.scaling.{gguf_key}"])
        return scaling
    raise ModelLoadError(f"{gguf.path}: {unsupported_rope_scaling(kind)}")


def gguf_weights(
    gguf: GGUFFile, config: ModelConfig, expand: bool = False
) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
    """Every tensor under its Hugging Face name, as stored (`expand`: as float32 values)."""
    arch = gguf.architecture
    model_class = model_class_for(config.architecture)  # it knows its checkpoints' names
    per_layer, global_names = model_class.gguf_layer_names, model_class.gguf_global_names
    expert_tensors: dict[str, tuple[str, ...]] = getattr(model_class, "gguf_expert_tensors", {})
    layer_prefix = model_class.gguf_layer_prefix
    for name in gguf.tensor_names():
        if name in _ROPE_FACTOR_TENSORS:
            continue  # part of the rotary scaling in the config
        stem, _, suffix = name.rpartition(".")  # suffix: weight | bias
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in expert_tensors:
            tensor = gguf.load_tensor(name) if expand else gguf.tensor(name)
            yield from _expert_slices(tensor, gguf.tensor_shape(name), parts[1], expert_tensors[parts[2]])
            continue
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in per_layer:
            hf_name = f"{layer_prefix}.{parts[1]}.{per_layer[parts[2]]}.{suffix}"
            module = parts[2]
        elif stem in global_names:
            hf_name, module = f"{global_names[stem]}.{suffix}", stem
        else:
            raise ModelLoadError(f"{gguf.path}: unexpected tensor {name!r} for architecture {arch!r}")
        tensor = gguf.load_tensor(name) if expand else gguf.tensor(name)
        if arch in _PERMUTED_QK and module in ("attn_q", "attn_k"):
            heads = config.num_heads if module == "attn_q" else config.num_kv_heads
            tensor = unpermute_qk(tensor, heads)
        if arch == "gpt2" and suffix == "weight" and module in ("attn_qkv", "attn_output", "ffn_up", "ffn_down"):
            tensor = tensor.t()  # Hugging Face's GPT-2 keeps these as Conv1D [in, out]
        yield hf_name, tensor

