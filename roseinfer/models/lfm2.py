"""LFM2 (Liquid AI): a hybrid decoder whose "conv" layers mix tokens with a gated short convolution
(layers/recurrent/short_conv.py: a few values of state per sequence, in a pool slot) and whose
other layers are Llama attention with per-head q/k RMSNorm (Qwen3's). Blocks, MLP (SwiGLU) and
norms are Llama's; the final norm is called embedding_norm. Checkpoint names are mapped onto the
Llama family's, whose loader (q/k/v and gate/up fusing, rotary layout) does the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from roseinfer.config import ModelConfig, RecurrentConfig
from roseinfer.layers.recurrent import ShortConvParams
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.llama import (
    LLAMA_GGUF_GLOBAL_NAMES,
    LLAMA_GGUF_LAYER_NAMES,
    LlamaBackbone,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from roseinfer.models.weights import dense

# Hugging Face's LFM2 names -> the Llama family's.
_HF_RENAMES = (
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".q_layernorm.", ".q_norm."),
    (".k_layernorm.", ".k_norm."),
    ("model.embedding_norm.", "model.norm."),
    (".conv.conv.weight", ".conv.conv_weight"),
    (".conv.conv.bias", ".conv.conv_bias"),
)


class Lfm2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer whose recurrent layers mix tokens with the short convolution (`conv`)."""

    recurrent_mixer = "conv"


class Lfm2Backbone(LlamaBackbone):
    layer_class = Lfm2DecoderLayer


class Lfm2ForCausalLM(LlamaForCausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {"lfm2": "lfm2"}
    gguf_architectures: ClassVar[dict[str, str]] = {"lfm2": "lfm2"}
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **LLAMA_GGUF_LAYER_NAMES,
        "shortconv.conv": "conv.conv",
        "shortconv.in_proj": "conv.in_proj",
        "shortconv.out_proj": "conv.out_proj",
    }
    gguf_global_names: ClassVar[dict[str, str]] = {**LLAMA_GGUF_GLOBAL_NAMES, "token_embd_norm": "model.embedding_norm"}

    backbone_class = Lfm2Backbone

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """LFM2's names as the Llama family's (its loader fuses and reorders), the convolution
        kernel as [channels, kernel]."""
        kernel = self.config.recurrent.params.kernel
        for name, tensor in weights:
            for old, new in _HF_RENAMES:
                name = name.replace(old, new)
            if name.endswith(".conv.conv_weight"):
                tensor = dense(tensor).reshape(-1, kernel)
            yield name, tensor

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        layers = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types") or [
            "full_attention" if i in (raw.get("full_attn_idxs") or range(layers)) else "conv" for i in range(layers)
        ]
        intermediate = raw.get("block_ff_dim") or raw["intermediate_size"]
        if raw.get("block_auto_adjust_ff_dim", True):  # as transformers' Lfm2MLP sizes itself
            intermediate = int(2 * intermediate / 3)
            multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
            if multiplier is not None:
                multiple = raw.get("block_multiple_of", 256)
                intermediate = multiple * ((int(multiplier * intermediate) + multiple - 1) // multiple)
        theta, scaling, _ = source.rope()
        fields = source.decoder_fields(tied=True)
        return source.build(
            **{**fields, "intermediate_size": intermediate, "norm_eps": raw.get("norm_eps", 1e-5)},
            rope_theta=theta, rope_scaling=scaling, qk_norm=True,
            recurrent=RecurrentConfig("short_conv", tuple(i for i, kind in enumerate(layer_types) if kind == "conv"),
                                      ShortConvParams(raw["hidden_size"], raw.get("conv_L_cache", 3),
                                                      bool(raw.get("conv_bias", False)))),
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        # head_count_kv per layer: 0 for the convolution layers
        kv_heads = source.key("attention.head_count_kv")
        kv_heads = list(kv_heads) if isinstance(kv_heads, list) else [kv_heads] * source.common["num_layers"]
        attention = [i for i, heads in enumerate(kv_heads) if heads]
        gguf = source.gguf
        return source.build(
            num_kv_heads=int(max(kv_heads)), head_dim=source.head_dim(),
            norm_eps=float(source.key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(source.key("rope.freq_base", 10000.0)), rope_scaling=source.rope_scaling(),
            qk_norm=bool(attention) and gguf.has_tensor(f"blk.{attention[0]}.attn_q_norm.weight"),
            recurrent=RecurrentConfig("short_conv", tuple(i for i, heads in enumerate(kv_heads) if not heads),
                                      ShortConvParams(source.common["hidden_size"], int(source.key("shortconv.l_cache")),
                                                      gguf.has_tensor(f"blk.{kv_heads.index(0)}.shortconv.in_proj.bias")
                                                      if 0 in kv_heads else False)),
        )
