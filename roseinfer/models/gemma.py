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
from typing import ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.layers.activation import gelu_tanh_and_mul
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import RotaryEmbedding, rope_inverse_frequencies
from roseinfer.models.fused_decode import DecodeModelSpec
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


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_local = config.layer_window(layer) is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = GemmaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotations: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: (this layer's output before its residual add, the residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rotations, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaBackbone(LlamaBackbone):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))


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

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.tp = get_tp_group()
        self.model = GemmaBackbone(config)
        self.vocab = self.model.embed_tokens.shard
        self.lm_head = nn.Linear(config.hidden_size, self.vocab.rows, bias=False)
        self.rotary = RotaryEmbedding(
            rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        )
        local_theta = config.rope_local_theta or config.rope_theta
        self.rotary_local = RotaryEmbedding(rope_inverse_frequencies(config.head_dim, local_theta))
        # Gemma 2's local layers rotate as its global ones; only Gemma 3 needs two tables.
        self.same_rotary = config.rope_scaling is None and local_theta == config.rope_theta

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the activations' dtype first, as transformers does
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        rotations = self.rotary.rotations(positions)
        local = rotations if self.same_rotary else self.rotary_local.rotations(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, local if layer.is_local else rotations, kv_cache, meta)
        return self.model.norm.add_and_norm(hidden, residual)[0]

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
                    attention_out_norm=layer.post_attention_layernorm.weight.detach(),
                    mlp_out_norm=layer.post_feedforward_layernorm.weight.detach(),
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
