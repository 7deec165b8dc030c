"""Decode steps of a Llama-family model in one C++ call (layers/csrc/llama_decode_cpu.cpp).

For float32 CPU models whose linear layers are blocked int4/int8 (`--quantization int4 | int8`):
there a decode step's arithmetic is a few milliseconds and the ~400 PyTorch operations of the
op-by-op forward would cost as much again in dispatch. The C++ decoder holds references to the
model's own tensors (no copies) and computes what the model computes, up to summation order; the
model runner uses it for steps that are all decodes, with up to `MAX_BATCH` requests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.layers.linear import BlockQuantLinear, PanelLinear, PrepackedLinear
from roseinfer.layers.rotary import RotaryEmbedding

MAX_BATCH = 16  # past this the op-by-op forward's dispatch cost is small beside its arithmetic


def _linear(layer: nn.Module) -> list[torch.Tensor | None]:
    return [layer.codes, layer.scales, layer.minimums, layer.bias]


def fused_decoder_for(
    model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> FusedDecoder | None:
    """The C++ decoder of `model`, or None where it does not apply (another architecture,
    activation, dtype or device, float linear layers, tensor-parallel shards, no C++ kernels)."""
    kernels = cpu_kernels()
    if (
        kernels is None
        or get_tp_group().size > 1  # the C++ step has no all-reduce between its layers
        or device.type != "cpu"
        or dtype != torch.float32
        or config.architecture != "llama"
        or config.hidden_act != "silu"
        or not all(isinstance(m, BlockQuantLinear) for m in model.modules() if _is_projection(m))
    ):
        return None
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append([
            layer.input_layernorm.weight.detach(),
            *_linear(attn.qkv_proj),
            attn.q_norm.weight.detach() if attn.qk_norm else None,
            attn.k_norm.weight.detach() if attn.qk_norm else None,
            *_linear(attn.o_proj),
            layer.post_attention_layernorm.weight.detach(),
            *_linear(mlp.gate_up_proj),
            *_linear(mlp.down_proj),
        ])
    return FusedDecoder(kernels.LlamaDecoder(
        config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
        config.norm_eps, model.model.norm.weight.detach(), _linear(model.lm_head), layers,
    ), model.model.embed_tokens, model.rotary)


class FusedDecoder:
    """The C++ step, fed the model's own token embeddings (the table may be stored as 8-bit
    blocks, see layers/parallel.py) and rotary angles: with the same cos/sin and the same rotation
    code (cpu_kernels.h) the two paths rotate q and k alike."""

    def __init__(self, decoder: Any, embedding: nn.Module, rotary: RotaryEmbedding) -> None:
        self.decoder = decoder
        self.embedding = embedding
        self.rotary = rotary

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """One decode step for every row: logits [rows, vocabulary]."""
        rotations = torch.view_as_real(self.rotary.rotations(positions))
        embedded = self.embedding(token_ids)
        return self.decoder.forward(embedded, rotations, slot_mapping, block_tables, context_lens, kv_caches)


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | BlockQuantLinear | PrepackedLinear | PanelLinear)
