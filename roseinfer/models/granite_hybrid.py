"""Granite 4 (granitemoehybrid): a hybrid decoder of Mamba2 layers (layers/recurrent/mamba2.py: a
state per sequence in a pool slot) and Llama attention layers, each followed by a mixture of
experts (softmax over the top-k router logits: models/moe.py's SparseMoeBlock, renormalised) plus
an always-on shared SwiGLU MLP.

Granite's scalings: embeddings times embedding_multiplier, every block's output times
residual_multiplier before it joins the residual stream, attention scores scaled by
attention_multiplier (not head_dim ** -0.5), logits divided by logits_scaling. The attention may
have no rotary embedding at all (position_embedding_type none: an identity rotation here).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig, MoeConfig, RecurrentConfig
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.recurrent import Mamba2Params
from roseinfer.layers.rotary import RotaryEmbedding, interleave_rotary_rows
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.decoder import (
    DecoderBackbone,
    DecoderForCausalLM,
    DecoderLayer,
    default_rotary,
)
from roseinfer.models.llama import LLAMA_GGUF_GLOBAL_NAMES, LLAMA_GGUF_LAYER_NAMES, LlamaAttention
from roseinfer.models.moe import GatedMLP, MoeForCausalLM, SparseMoeBlock, _canonical_names
from roseinfer.models.weights import ModuleLoaded, WeightLoader, dense

# Granite's checkpoint names for the experts: [experts, 2 * width, hidden] gate and up, [experts,
# hidden, width] down, and the router -> the stacked names models/moe.py's _canonical_names splits.
_GRANITE_EXPERTS = {
    ".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
    ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
    ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.gate.weight",
}


def _stacked_expert_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        for old, new in _GRANITE_EXPERTS.items():
            if name.endswith(old):
                name = name.removesuffix(old) + new
        yield name, tensor


class GraniteHybridLayer(DecoderLayer):
    """Mamba2 (`mamba`) or Llama attention scaled by attention_multiplier, then the experts (if
    any) plus the shared MLP; both blocks' outputs scaled by residual_multiplier."""

    recurrent_mixer = "mamba"

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.residual_multiplier = config.family_options["residual_multiplier"]
        self.shared_mlp = GatedMLP(config.hidden_size, config.family_options["shared_intermediate_size"], reduce=True)

    def make_attention(self, config: ModelConfig, layer: int) -> nn.Module:
        attention = LlamaAttention(config, layer)
        attention.attn = PagedAttention(attention.num_heads, attention.num_kv_heads, config.head_dim,
                                        config.family_options["attention_multiplier"])
        return attention

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        return SparseMoeBlock(config) if config.moe is not None else None

    def mix(self, hidden: torch.Tensor, rotations: torch.Tensor, cache: Any, meta: AttentionMetadata) -> torch.Tensor:
        return super().mix(hidden, rotations, cache, meta) * self.residual_multiplier

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.shared_mlp(hidden)
        if self.mlp is not None:
            out = out + self.mlp(hidden)
        return out * self.residual_multiplier


class GraniteHybridBackbone(DecoderBackbone):
    layer_class = GraniteHybridLayer


class GraniteHybridForCausalLM(DecoderForCausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {"granitemoehybrid": "granite_hybrid"}
    gguf_architectures: ClassVar[dict[str, str]] = {"granitehybrid": "granite_hybrid"}
    gguf_layer_prefix: ClassVar[str] = "model.layers"
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **LLAMA_GGUF_LAYER_NAMES,
        "ffn_gate_inp": "mlp.gate",
        # a model without experts (granite-4.0-h-micro): the converter writes its shared MLP as the FFN
        "ffn_gate": "shared_mlp.gate_proj",
        "ffn_up": "shared_mlp.up_proj",
        "ffn_down": "shared_mlp.down_proj",
        "ffn_gate_shexp": "shared_mlp.gate_proj",
        "ffn_up_shexp": "shared_mlp.up_proj",
        "ffn_down_shexp": "shared_mlp.down_proj",
        "ssm_in": "mamba.in_proj",
        "ssm_out": "mamba.out_proj",
        "ssm_conv1d": "mamba.conv1d",
        "ssm_dt": "mamba.dt",  # .bias: dt_bias
        "ssm_a": "mamba.ssm_a",  # -exp(A_log), [heads, 1]
        "ssm_d": "mamba.ssm_d",  # D, [heads, 1]
        "ssm_norm": "mamba.norm",  # [groups, inner / groups]
    }
    gguf_global_names: ClassVar[dict[str, str]] = LLAMA_GGUF_GLOBAL_NAMES
    gguf_expert_tensors: ClassVar[dict[str, tuple[str, ...]]] = MoeForCausalLM.gguf_expert_tensors

    backbone_class = GraniteHybridBackbone

    def build_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        if config.family_options["rope"]:
            return default_rotary(config)
        return RotaryEmbedding(torch.zeros(config.head_dim // 2, device="cpu"))  # no positions: a rotation by 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.config.family_options["embedding_multiplier"]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.config.family_options["logits_scaling"]

    def load_weights(self, weights: Iterable[tuple[str, Any]], on_module_loaded: ModuleLoaded | None = None) -> None:
        loader = WeightLoader(self, on_module_loaded)
        for name, tensor in _canonical_names(_stacked_expert_names(weights)):  # experts one by one, under mlp.
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            prefix, module, leaf = ".".join(parts[:-2]), parts[-2] if len(parts) > 1 else "", parts[-1]
            if "mamba" in parts:
                self._load_mamba(loader, name, tensor)
            elif module in ("q_proj", "k_proj", "v_proj"):
                attention = self.get_submodule(prefix)
                heads = attention.num_heads if module == "q_proj" else attention.num_kv_heads
                if module != "v_proj":
                    tensor = interleave_rotary_rows(tensor, heads)
                first = {"q_proj": 0, "k_proj": attention.q_size, "v_proj": attention.q_size + attention.kv_size}[module]
                loader.load_rows(f"{prefix}.qkv_proj.{leaf}", tensor, first)
            elif module == "input_linear":  # the shared MLP's gate and up, in that order
                loader.load(f"{prefix}.gate_up_proj.{leaf}", tensor)
            elif module == "output_linear":
                loader.load(f"{prefix}.down_proj.{leaf}", tensor)
            elif module in ("gate_proj", "up_proj"):  # an expert's
                owner = self.get_submodule(prefix)
                first = 0 if module == "gate_proj" else owner.intermediate_size
                loader.load_rows(f"{prefix}.gate_up_proj.{leaf}", tensor, first)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                loader.load(name, self.vocab.of(tensor))
            else:
                loader.load(name, tensor)
        self.finish_load(loader, self.model.embed_tokens)

    def _load_mamba(self, loader: WeightLoader, name: str, tensor: Any) -> None:
        prefix, _, leaf = name.partition(".mamba.")
        mixer = f"{prefix}.mamba"
        values = dense(tensor)
        if leaf == "conv1d.weight":
            loader.load(f"{mixer}.conv_weight", values.reshape(values.shape[0], -1))
        elif leaf == "conv1d.bias":
            loader.load(f"{mixer}.conv_bias", values)
        elif leaf == "A_log":
            loader.load(f"{mixer}.decay_rate", -values.float().exp())
        elif leaf == "ssm_a":  # GGUF: -exp(A_log) already
            loader.load(f"{mixer}.decay_rate", values.reshape(-1))
        elif leaf in ("D", "ssm_d"):
            loader.load(f"{mixer}.skip", values.reshape(-1))
        elif leaf == "dt.bias":
            loader.load(f"{mixer}.dt_bias", values)
        elif leaf == "norm.weight":
            loader.load(f"{mixer}.norm_weight", values.reshape(-1))
        else:  # in_proj, out_proj, dt_bias
            loader.load(name, tensor)

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        if raw.get("hidden_act", "silu") != "silu":
            raise source.error(f"activation {raw['hidden_act']!r} is not supported (silu only)")
        limit = raw.get("time_step_limit")  # transformers 5 writes infinity as {"__float__": "Infinity"}
        upper = limit[1] if limit is not None else None
        upper = float(upper["__float__"]) if isinstance(upper, dict) else upper
        if limit is not None and (float(limit[0]) != 0.0 or upper != float("inf")):
            raise source.error(f"time_step_limit {limit} is not supported (only the default (0, inf))")
        layers = raw["num_hidden_layers"]
        kinds = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * layers
        mamba_layers = tuple(i for i, kind in enumerate(kinds) if kind in ("mamba", "linear_attention"))
        hidden = raw["hidden_size"]
        heads = raw.get("mamba_n_heads", 128)
        inner = raw.get("mamba_expand", 2) * hidden
        head_dim = raw.get("mamba_d_head", "auto")
        params = Mamba2Params(
            hidden_size=hidden, num_heads=heads, head_dim=inner // heads if head_dim == "auto" else head_dim,
            state_size=raw.get("mamba_d_state", 256), num_groups=raw.get("mamba_n_groups", 1),
            conv_kernel=raw.get("mamba_d_conv", 4), norm_eps=raw.get("rms_norm_eps", 1e-6),
            conv_bias=bool(raw.get("mamba_conv_bias", True)), proj_bias=bool(raw.get("mamba_proj_bias", False)),
        )
        moe = None
        if raw.get("num_local_experts"):
            moe = MoeConfig(num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"],
                            intermediate_size=raw["intermediate_size"], norm_topk_prob=True)
        theta, scaling, _ = source.rope()
        return source.build(
            **source.decoder_fields(),
            rope_theta=theta, rope_scaling=scaling, attention_bias=bool(raw.get("attention_bias", False)),
            moe=moe, recurrent=RecurrentConfig("mamba2", mamba_layers, params),
            family_options={
                "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
                "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
                "attention_multiplier": float(raw.get("attention_multiplier", 1.0)),
                "logits_scaling": float(raw.get("logits_scaling", 1.0)),
                "shared_intermediate_size": raw.get("shared_intermediate_size", 1024),
                "rope": raw.get("position_embedding_type") == "rope",
            },
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        gguf, common = source.gguf, source.common
        layers = common["num_layers"]
        # The attention layers are those with attention tensors (head_count_kv, one per layer, is 0
        # for the others, but a converter that misread the layer types writes 0 everywhere).
        attention = [i for i in range(layers) if gguf.has_tensor(f"blk.{i}.attn_q.weight")]
        head_dim = source.head_dim()
        num_kv_heads = gguf.tensor_shape(f"blk.{attention[0]}.attn_k.weight")[0] // head_dim if attention else 1
        heads = int(source.key("ssm.time_step_rank"))
        inner = int(source.key("ssm.inner_size"))
        norm_eps = float(source.key("attention.layer_norm_rms_epsilon", 1e-5))
        params = Mamba2Params(
            hidden_size=common["hidden_size"], num_heads=heads, head_dim=inner // heads,
            state_size=int(source.key("ssm.state_size")), num_groups=int(source.key("ssm.group_count")),
            conv_kernel=int(source.key("ssm.conv_kernel")), norm_eps=norm_eps,
            conv_bias=any(gguf.has_tensor(f"blk.{i}.ssm_conv1d.bias") for i in range(layers)),
            proj_bias=any(gguf.has_tensor(f"blk.{i}.ssm_in.bias") for i in range(layers)),
        )
        moe = None
        if int(source.get("expert_count") or 0):
            moe = MoeConfig(num_experts=int(source.key("expert_count")), top_k=int(source.key("expert_used_count")),
                            intermediate_size=common["intermediate_size"], norm_topk_prob=True)
        return source.build(
            num_kv_heads=num_kv_heads, head_dim=head_dim, norm_eps=norm_eps,
            rope_theta=float(source.key("rope.freq_base", 10000.0)), rope_scaling=None, moe=moe,
            recurrent=RecurrentConfig("mamba2", tuple(i for i in range(layers) if i not in attention), params),
            family_options={
                "embedding_multiplier": float(source.get("embedding_scale", 1.0)),
                "residual_multiplier": float(source.get("residual_scale", 1.0)),
                "attention_multiplier": float(source.get("attention.scale", 1.0)),
                "logits_scaling": float(source.get("logit_scale", 1.0)),
                "shared_intermediate_size": gguf.tensor_shape(
                    "blk.0.ffn_up_shexp.weight" if moe is not None else "blk.0.ffn_up.weight")[0],
                # llama.cpp rotates a Granite hybrid's attention only where this flag is set
                "rope": bool(source.get("rope.scaling.finetuned", False)),
            },
        )
