"""Gemma 2 and Gemma 3 (text) in plain PyTorch.

Against the Llama family (whose attention projections, tensor-parallel slicing and weight fusing
they share, see llama.py):
- local (sliding-window) layers interleaved with global ones (`ModelConfig.layer_types`); Gemma 3's
  local layers rotate with their own base (rope_local_base_freq), its global ones with rope_theta
  and the rotary scaling;
- attention scores and final logits soft-capped (Gemma 2), q/k RMSNorm per head (Gemma 3);
- a norm after attention and around the MLP (four per layer), RMSNorm weights w applied as 1 + w
  (added once at load time; GGUF files store 1 + w already), GeGLU (GELU, tanh approximation);
- token embeddings scaled by sqrt(hidden_size), queries by query_pre_attn_scalar ** -0.5.

A local layer's attention reads only the last `sliding_window` positions of its pool (the C++
kernel walks the block table from the window's first block; the PyTorch paths mask the rest).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.layers.activation import gelu_tanh_and_mul
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.decoder import DecoderLayer
from roseinfer.models.fused_decode import DecodeModelSpec, PostNorms
from roseinfer.models.llama import (
    LLAMA_GGUF_LAYER_NAMES,
    LlamaAttention,
    LlamaBackbone,
    LlamaForCausalLM,
    LlamaMLP,
    decode_layer_spec,
)
from roseinfer.models.weights import ModuleLoaded

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm", "q_norm", "k_norm", "norm")


class GemmaAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, config.head_dim, config.query_pre_attn_scalar**-0.5,
            sliding_window=config.layer_window(layer), softcap=config.attn_logit_softcapping,
        )


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x))))


class GemmaDecoderLayer(DecoderLayer):
    """The shared pre-norm layer with Gemma's two more norms: one of the attention's output
    (post_attention_layernorm), one of the MLP's (post_feedforward_layernorm); the norm before the
    MLP is pre_feedforward_layernorm."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.is_local = config.layer_window(layer) is not None
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def make_attention(self, config: ModelConfig, layer: int) -> nn.Module:
        return GemmaAttention(config, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return GemmaMLP(config)

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm

    def mix(self, hidden: torch.Tensor, rotations: torch.Tensor, cache: Any, meta: AttentionMetadata) -> torch.Tensor:
        return self.post_attention_layernorm(super().mix(hidden, rotations, cache, meta))

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(self.mlp(hidden))


class GemmaBackbone(LlamaBackbone):
    layer_class = GemmaDecoderLayer


class GemmaForCausalLM(LlamaForCausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
    gguf_architectures: ClassVar[dict[str, str]] = {"gemma2": "gemma2", "gemma3": "gemma3"}
    # llama.cpp's names of the four norms of a layer.
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **LLAMA_GGUF_LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }

    backbone_class = GemmaBackbone

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        local_theta = config.rope_local_theta or config.rope_theta
        self.rotary_local = RotaryEmbedding(rope_inverse_frequencies(config.head_dim, local_theta))
        # Gemma 2's local layers rotate as its global ones; only Gemma 3 needs two tables.
        self.same_rotary = config.rope_scaling is None and local_theta == config.rope_theta

    def build_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the activations' dtype first, as transformers does
        return hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)

    def layer_rotations(self, positions: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor]:
        """The local layers' table where it differs from the global layers' (Gemma 3)."""
        rotations = self.rotary.rotations(positions)
        local = rotations if self.same_rotary else self.rotary_local.rotations(positions)
        return [local if layer.is_local else rotations for layer in self.model.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def fused_decode_spec(self) -> DecodeModelSpec | None:
        """Gemma's decode step, described whole (GeGLU, four norms a layer, scaled embeddings,
        soft-caps, a window and a rotary table per kind of layer), as the fused C++ step
        (models/fused_decode.py) computes it."""
        config = self.config
        return DecodeModelSpec(
            embedding=self.model.embed_tokens,
            layers=tuple(
                decode_layer_spec(
                    layer, layer.pre_feedforward_layernorm,
                    self.rotary_local if layer.is_local and not self.same_rotary else self.rotary, "gelu_tanh",
                    post_norms=PostNorms(layer.post_attention_layernorm.weight.detach(),
                                         layer.post_feedforward_layernorm.weight.detach()),
                )
                for layer in self.model.layers
            ),
            final_norm=self.model.norm.weight.detach(),
            norm_eps=self.model.norm.eps,
            lm_head=self.lm_head,
            hidden_size=config.hidden_size,
            embedding_scale=config.hidden_size**0.5,
            final_logit_softcap=config.final_logit_softcapping or None,
        )

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], on_module_loaded: ModuleLoaded | None = None
    ) -> None:
        """As Llama's, with each RMSNorm weight w stored as the scale it applies: offset + w."""
        offset = self.config.norm_weight_offset

        def with_offsets() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = name.split(".")
                if offset and len(parts) > 1 and parts[-2] in _NORMS and parts[-1] == "weight":
                    tensor = tensor.float() + offset  # in float32, as transformers adds it
                yield name, tensor

        super().load_weights(with_offsets(), on_module_loaded)

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        if raw.get("use_bidirectional_attention"):
            raise source.error("use_bidirectional_attention (an embedding model) is not supported")
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise source.error(f"Gemma activation {activation!r} is not supported (gelu_pytorch_tanh)")
        layers = raw["num_hidden_layers"]
        period = raw.get("sliding_window_pattern", _HF_LAYER_PERIOD[source.model_type])
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
                raise source.error("rotary scaling of the sliding layers is not supported")
        else:
            theta, scaling, _ = source.rope()  # Gemma: no partial rotary
            local_theta = float(raw.get("rope_local_base_freq", theta)) if source.model_type == "gemma3_text" else theta
        fields = source.decoder_fields(max_positions=8192, tied=True)
        return source.build(
            **fields,
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=raw.get("attention_bias", False),
            qk_norm=source.architecture == "gemma3",
            hidden_act="gelu_pytorch_tanh",
            sliding_window=raw.get("sliding_window"),
            layer_types=layer_types,
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or fields["head_dim"]),
            rope_local_theta=local_theta,
            norm_weight_offset=1.0,
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        arch, common = source.arch, source.common
        period, layers_27b = _GGUF_LAYOUT[arch]
        layers = common["num_layers"]
        window = source.get("attention.sliding_window")
        pattern = source.get("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer: whether it slides
            layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
        else:
            period = int(pattern or period)
            layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
        fields = source.attention_fields()
        heads, head_dim = common["num_heads"], fields["head_dim"]
        if source.get("attention.scale") is not None:
            scalar = float(source.get("attention.scale")) ** -2
        else:
            scalar = common["hidden_size"] / heads if layers == layers_27b else head_dim
        scaling = None
        if source.get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(source.key("rope.scaling.factor"))}
        elif source.get("rope.scaling.type") not in (None, "none"):
            raise source.error(f"rope scaling {source.get('rope.scaling.type')!r} is not supported")
        theta = float(source.key("rope.freq_base", 10000.0 if arch == "gemma2" else 1_000_000.0))
        # The instruct models end each turn with <end_of_turn> (their generation_config.json lists
        # it beside <eos>), but llama.cpp's converter writes only <eos>; llama.cpp finds the other
        # by its text when loading, and so do we.
        tokens = source.metadata.get("tokenizer.ggml.tokens") or []
        end_of_turn = [tokens.index("<end_of_turn>")] if "<end_of_turn>" in tokens else []
        return source.build(
            **fields,
            eos_token_ids=list(dict.fromkeys(common["eos_token_ids"] + end_of_turn)),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=arch == "gemma3",
            hidden_act="gelu_pytorch_tanh",
            sliding_window=int(window) if window else None,
            layer_types=layer_types if window else None,
            attn_logit_softcapping=source.get("attn_logit_softcapping"),
            final_logit_softcapping=source.get("final_logit_softcapping"),
            query_pre_attn_scalar=float(scalar),
            rope_local_theta=float(source.get("rope.freq_base_swa", 10000.0 if arch == "gemma3" else theta)),
            norm_weight_offset=0.0,  # the converter stored 1 + w
        )


# Hugging Face model_type -> the period of its default layer pattern (every n-th layer global).
_HF_LAYER_PERIOD = {"gemma2": 2, "gemma3_text": 6}
# GGUF architecture -> the period of llama.cpp's layer pattern, which the converter does not write
# (llama.cpp hard-codes it), and the layer count of the 27B model, whose queries llama.cpp scales
# by (hidden / heads) ** -0.5 (its query_pre_attn_scalar) instead of head_dim ** -0.5.
_GGUF_LAYOUT = {"gemma2": (2, 46), "gemma3": (6, 62)}
