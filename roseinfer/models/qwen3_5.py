"""Qwen3.5, Qwen3.5-MoE (Qwen3.6) and Qwen3-Next: hybrid decoders in plain PyTorch.

Three layers in four (the model's `layer_types`) mix tokens with Gated DeltaNet linear attention
(layers/recurrent/gated_delta_net.py: a fixed-size state per sequence, in a pool slot); the others
with gated full attention over the paged KV cache: Qwen3's attention (per-head q/k RMSNorm, grouped
KV heads) with partial rotary (the first quarter of each head) and an output gate (q_proj gives each
head its queries and a gate; the output is multiplied by sigmoid(gate) before o_proj). Every RMSNorm
but the Gated DeltaNet's own scales by 1 + w (added once at load; GGUF files store 1 + w already).
The MLP is SwiGLU (Qwen3.5) or a mixture of experts with a shared expert behind a sigmoid gate
(Qwen3.5-MoE, Qwen3-Next: models/moe.py's SparseMoeBlock).

The three families differ only in their checkpoints: Qwen3-Next's linear-attention projections
interleave q, k, v, z (and b, a) per key head (`in_proj_qkvz`, `in_proj_ba`), Qwen3.5's keep them
apart; llama.cpp's converter orders Qwen3.5's value heads tiled over the key heads
(GatedDeltaNetParams.v_heads_tiled). Qwen3.5's multimodal rotary (MRoPE) is the plain rotary for
text, whose three position streams are equal. MTP layers and the vision tower are skipped at load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig, MoeConfig, RecurrentConfig
from roseinfer.errors import ModelLoadError
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.quantization import permute_rows
from roseinfer.layers.quantization.gguf import BlockTensor
from roseinfer.layers.recurrent import GatedDeltaNetParams
from roseinfer.layers.rotary import (
    apply_rotary,
    interleave_rotary_rows,
)
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.decoder import DecoderBackbone, DecoderForCausalLM, DecoderLayer
from roseinfer.models.llama import LLAMA_GGUF_GLOBAL_NAMES, LLAMA_GGUF_LAYER_NAMES
from roseinfer.models.moe import GatedMLP, MoeForCausalLM, SparseMoeBlock, _canonical_names
from roseinfer.models.weights import ModuleLoaded, WeightLoader, dense

# The norms that scale by 1 + w (the Gated DeltaNet's own norm scales by w).
_OFFSET_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm")


class GatedAttention(nn.Module):
    """Full attention with q/k norms, partial rotary and a sigmoid output gate. `qkv_proj` rows:
    queries, keys, values, then the gate (the checkpoint's q_proj, which interleaves each head's
    queries and gate, split at load)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self, hidden: torch.Tensor, rotations: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v, gate = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size, self.q_size], -1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rotations), apply_rotary(k, rotations)
        out = self.attn(q, k, v, kv_cache, meta).reshape(num_tokens, self.q_size)
        return self.o_proj(out * torch.sigmoid(gate))


class HybridDecoderLayer(DecoderLayer):
    """Gated DeltaNet (`linear_attn`) or gated full attention, then SwiGLU or experts."""

    recurrent_mixer = "linear_attn"

    def make_attention(self, config: ModelConfig, layer: int) -> nn.Module:
        return GatedAttention(config)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        if config.moe is not None and layer not in config.moe.dense_layers:
            return SparseMoeBlock(config)
        return GatedMLP(config.hidden_size, config.intermediate_size, reduce=True)


class HybridBackbone(DecoderBackbone):
    layer_class = HybridDecoderLayer


def _dense(tensor: torch.Tensor | BlockTensor) -> torch.Tensor:
    """A small parameter (conv kernel, decay rates) as float32 values, whatever its file type."""
    return dense(tensor).float()


class Qwen35ForCausalLM(DecoderForCausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {
        "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
        "qwen3_next": "qwen3_5",
    }
    gguf_architectures: ClassVar[dict[str, str]] = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5", "qwen3next": "qwen3_5"}
    gguf_layer_prefix: ClassVar[str] = "model.layers"
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **LLAMA_GGUF_LAYER_NAMES,
        **{k: v for k, v in MoeForCausalLM.gguf_layer_names.items() if k not in LLAMA_GGUF_LAYER_NAMES},
        "post_attention_norm": "post_attention_layernorm",
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_ba": "linear_attn.in_proj_ba",  # Qwen3-Next: b and a interleaved per key head
        "ssm_a": "linear_attn.decay_rate",  # -exp(A_log)
        "ssm_conv1d": "linear_attn.conv1d",
        "ssm_dt": "linear_attn.dt",  # .bias: dt_bias
        "ssm_norm": "linear_attn.norm",
        "ssm_out": "linear_attn.out_proj",
        # A file's MTP layers (blocks past the model's own): read, then skipped (_text_weights).
        **{f"nextn.{name}": f"nextn.{name}" for name in (
            "eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm")},
    }
    gguf_global_names: ClassVar[dict[str, str]] = LLAMA_GGUF_GLOBAL_NAMES
    gguf_expert_tensors: ClassVar[dict[str, tuple[str, ...]]] = MoeForCausalLM.gguf_expert_tensors

    backbone_class = HybridBackbone

    def __init__(self, config: ModelConfig) -> None:
        if config.recurrent is None:
            raise ModelLoadError("a hybrid model needs its recurrent layers (ModelConfig.recurrent)")
        super().__init__(config)

    # -- weights --------------------------------------------------------------------------

    def _text_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The language model's tensors under one naming: a multimodal checkpoint's
        `model.language_model.` prefix dropped, its vision tower and the MTP layers skipped."""
        for name, tensor in weights:
            if name.startswith(("model.visual.", "visual.", "mtp.", "model.mtp.")):
                continue
            name = name.replace("model.language_model.", "model.", 1)
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_layers:
                continue  # an MTP layer a GGUF file counts among its blocks
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]], on_module_loaded: ModuleLoaded | None = None) -> None:
        """Hugging Face-named tensors (or GGUF ones under those names, see gguf_layer_names): the
        linear-attention projections fused into `in_proj`, q (and its gate) / k / v into
        `qkv_proj`, gate/up pairs fused, q/k rows in the interleaved rotary layout, norms as the
        scale they apply."""
        config = self.config
        loader = WeightLoader(self, on_module_loaded)
        for name, tensor in _canonical_names(self._text_weights(weights)):
            if self.skips_tensor(name):
                continue
            parts = name.split(".")
            if "linear_attn" in parts:
                at = parts.index("linear_attn")
                self._load_linear_attention(loader, ".".join(parts[: at + 1]), ".".join(parts[at + 1:]), tensor)
            elif "self_attn" in parts:
                at = parts.index("self_attn")
                self._load_attention(loader, ".".join(parts[: at + 1]), ".".join(parts[at + 1:]), tensor)
            elif len(parts) > 1 and parts[-2] in _OFFSET_NORMS:
                loader.load(name, _dense(tensor) + config.norm_weight_offset)
            elif len(parts) > 1 and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
                owner = self.get_submodule(".".join(parts[:-2]))
                if parts[-2] == "down_proj":
                    loader.load(name, tensor)
                else:
                    first = 0 if parts[-2] == "gate_proj" else owner.intermediate_size
                    loader.load_rows(".".join([*parts[:-2], "gate_up_proj", parts[-1]]), tensor, first)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                loader.load(name, self.vocab.of(tensor))
            else:
                loader.load(name, tensor)
        self.finish_load(loader, self.model.embed_tokens)

    def _load_attention(self, loader: WeightLoader, prefix: str, leaf: str, tensor: Any) -> None:
        config, attention = self.config, self.get_submodule(prefix)
        rotary_dim = config.rotary_dim
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        module, _, kind = leaf.partition(".")
        fused = f"{prefix}.qkv_proj.{kind}"
        if module == "q_proj":  # per head [queries, gate] -> all queries, then all gates
            tensor = permute_rows(tensor, lambda rows: rows.reshape(heads, 2, head_dim, *rows.shape[1:])
                                  .transpose(0, 1).reshape(rows.shape))
            size = attention.q_size
            queries, gate = tensor.narrow(0, 0, size), tensor.narrow(0, size, size)
            loader.load_rows(fused, interleave_rotary_rows(queries, heads, rotary_dim), 0)
            loader.load_rows(fused, gate, size + 2 * attention.kv_size)
        elif module == "k_proj":
            loader.load_rows(fused, interleave_rotary_rows(tensor, kv_heads, rotary_dim), attention.q_size)
        elif module == "v_proj":
            loader.load_rows(fused, tensor, attention.q_size + attention.kv_size)
        elif module in ("q_norm", "k_norm"):
            weight = interleave_rotary_rows(_dense(tensor), 1, rotary_dim) + config.norm_weight_offset
            loader.load(f"{prefix}.{leaf}", weight)
        else:
            loader.load(f"{prefix}.{leaf}", tensor)

    def _load_linear_attention(self, loader: WeightLoader, prefix: str, leaf: str, tensor: Any) -> None:
        layer = self.get_submodule(prefix)
        p: GatedDeltaNetParams = layer.params
        fused = f"{prefix}.in_proj.weight"
        rows = {"in_proj_qkv.weight": 0, "in_proj_z.weight": p.conv_dim, "in_proj_b.weight": p.conv_dim + p.value_dim,
                "in_proj_a.weight": p.conv_dim + p.value_dim + p.num_v_heads}
        per_k = p.num_v_heads // p.num_k_heads
        if leaf in rows:
            loader.load_rows(fused, tensor, rows[leaf])
        elif leaf == "in_proj_qkvz.weight":  # Qwen3-Next: per key head [q, k, v, z] -> q, k, v, z
            widths = [p.head_k_dim, p.head_k_dim, per_k * p.head_v_dim, per_k * p.head_v_dim]

            def regroup(r: torch.Tensor) -> torch.Tensor:
                groups = r.reshape(p.num_k_heads, sum(widths), *r.shape[1:]).split(widths, dim=1)
                return torch.cat([g.reshape(-1, *r.shape[1:]) for g in groups])

            tensor = permute_rows(tensor, regroup)
            qkv, z = (tensor.narrow(0, 0, p.conv_dim), tensor.narrow(0, p.conv_dim, p.value_dim))
            loader.load_rows(fused, qkv, 0)
            loader.load_rows(fused, z, p.conv_dim)
        elif leaf == "in_proj_ba.weight":  # Qwen3-Next: per key head [b, a] -> b, then a

            def regroup_ba(r: torch.Tensor) -> torch.Tensor:
                return r.reshape(p.num_k_heads, 2, per_k, *r.shape[1:]).transpose(0, 1).reshape(r.shape)

            loader.load_rows(fused, permute_rows(tensor, regroup_ba), p.conv_dim + p.value_dim)
        elif leaf == "conv1d.weight":
            loader.load(f"{prefix}.conv_weight", _dense(tensor).reshape(p.conv_dim, p.conv_kernel))
        elif leaf == "A_log":
            loader.load(f"{prefix}.decay_rate", -_dense(tensor).exp())
        elif leaf == "decay_rate":  # GGUF's ssm_a: -exp(A_log) already
            loader.load(f"{prefix}.decay_rate", _dense(tensor))
        elif leaf in ("dt_bias", "dt.bias"):
            loader.load(f"{prefix}.dt_bias", _dense(tensor))
        elif leaf == "norm.weight":
            loader.load(f"{prefix}.norm_weight", _dense(tensor))
        else:
            loader.load(f"{prefix}.{leaf}", tensor)

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        if "text_config" in source.raw:  # a multimodal checkpoint: the language model's config inside
            source = dataclasses.replace(source, raw={**source.raw["text_config"], "model_type": source.model_type})
        if "intermediate_size" not in source.raw:  # Qwen3.5-MoE: every layer's MLP is experts
            source = dataclasses.replace(source, raw={**source.raw, "intermediate_size": 0})
        raw, model_type = source.raw, source.model_type
        if raw.get("hidden_act", "silu") != "silu":
            raise source.error(f"activation {raw['hidden_act']!r} is not supported (silu only)")
        num_layers = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types") or [
            "full_attention" if (i + 1) % raw.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(num_layers)
        ]
        unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
        if unknown:
            raise source.error(f"layer types {unknown} are not supported")
        theta, scaling, partial = source.rope()
        fields = source.decoder_fields()
        params = GatedDeltaNetParams(
            hidden_size=raw["hidden_size"], num_k_heads=raw["linear_num_key_heads"],
            num_v_heads=raw["linear_num_value_heads"], head_k_dim=raw["linear_key_head_dim"],
            head_v_dim=raw["linear_value_head_dim"], conv_kernel=raw["linear_conv_kernel_dim"],
            norm_eps=fields["norm_eps"],
        )
        moe = None
        if raw.get("num_experts"):
            step = raw.get("decoder_sparse_step") or 1
            moe = MoeConfig(
                num_experts=raw["num_experts"], top_k=raw["num_experts_per_tok"],
                intermediate_size=raw["moe_intermediate_size"],
                # Qwen3.5-MoE's router always renormalises; Qwen3-Next's where the config says.
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if model_type == "qwen3_next" else True,
                shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
                dense_layers=tuple(i for i in range(num_layers)
                                   if i in (raw.get("mlp_only_layers") or []) or (i + 1) % step),
            )
        return source.build(
            **fields,
            rope_theta=theta, rope_scaling=scaling,
            rotary_dim=int(fields["head_dim"] * partial) if partial != 1.0 else None,
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=True, norm_weight_offset=1.0, moe=moe,
            recurrent=RecurrentConfig("gated_delta_net", tuple(
                i for i, kind in enumerate(layer_types) if kind == "linear_attention"), params),
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        arch, gguf, common = source.arch, source.gguf, source.common
        # A file with MTP layers counts them among its blocks (after the model's own).
        num_layers = common["num_layers"] - int(source.get("nextn_predict_layers", 0) or 0)
        recurrent_flags = source.get("attention.recurrent_layers")
        if recurrent_flags is not None:
            layers = tuple(i for i, flag in enumerate(recurrent_flags[:num_layers]) if flag)
        else:
            interval = int(source.key("full_attention_interval", 4))
            layers = tuple(i for i in range(num_layers) if (i + 1) % interval)
        fields = source.attention_fields()
        num_k, num_v = int(source.key("ssm.group_count")), int(source.key("ssm.time_step_rank"))
        params = GatedDeltaNetParams(
            hidden_size=common["hidden_size"], num_k_heads=num_k, num_v_heads=num_v,
            head_k_dim=int(source.key("ssm.state_size")), head_v_dim=int(source.key("ssm.inner_size")) // num_v,
            conv_kernel=int(source.key("ssm.conv_kernel")), norm_eps=fields["norm_eps"],
            v_heads_tiled=arch in ("qwen35", "qwen35moe") and num_k != num_v,
        )
        moe = None
        if int(source.get("expert_count") or 0):
            shared = gguf.tensor_shape("blk.0.ffn_up_shexp.weight")[0] if gguf.has_tensor("blk.0.ffn_up_shexp.weight") else 0
            moe = MoeConfig(
                num_experts=int(source.key("expert_count")), top_k=int(source.key("expert_used_count")),
                intermediate_size=int(source.key("expert_feed_forward_length")),
                norm_topk_prob=bool(source.get("expert_weights_norm", True)),
                shared_expert_intermediate_size=shared,
                dense_layers=tuple(i for i in range(num_layers) if not gguf.has_tensor(f"blk.{i}.ffn_gate_inp.weight")),
            )
        rotary_dim = source.get("rope.dimension_count")
        return source.build(
            **fields, num_layers=num_layers,
            rope_theta=float(source.key("rope.freq_base", 10000.0)),
            rope_scaling=source.rope_scaling(),
            rotary_dim=int(rotary_dim) if rotary_dim is not None and int(rotary_dim) != fields["head_dim"] else None,
            attention_bias=any(gguf.has_tensor(f"blk.{i}.attn_q.bias") for i in range(num_layers)),
            qk_norm=True, norm_weight_offset=0.0, moe=moe,  # the converter stored 1 + w
            recurrent=RecurrentConfig("gated_delta_net", layers, params),
        )
