"""Decode steps of a Llama-family model in one C++ call (layers/csrc/llama_decode_cpu.cpp).

Run op by op, a decode step is ~400 PyTorch operations, and at small batches their dispatch costs
as much as their arithmetic (a 30-layer model: ~5 ms a token). The C++ step applies to CPU models
whose linear layers it can call directly: float32 or bfloat16 weights on the panel kernel
(`--quantization none` on CPUs with AVX-512 and no AMX; a float32 LM head may be 8-bit blocks),
or float32 models with blocked int4/int8 weights. It holds references to the model's own tensors
(no copies) and computes what the model computes, with the same row functions and linear kernels,
up to summation order; the model runner uses it for steps that are all decodes, with up to
`max_batch` requests.
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

# Blocked weights past this many rows: the op-by-op forward expands them for a matrix product
# (BlockQuantLinear.SMALL_BATCH), which the C++ step does not.
MAX_BLOCKED_BATCH = BlockQuantLinear.SMALL_BATCH


def _linear(layer: nn.Module) -> list[torch.Tensor | None]:
    if isinstance(layer, PanelLinear):
        return [layer.panels, layer.panel_bias, None, None]
    return [layer.codes, layer.scales, layer.minimums, layer.bias]


def _callable(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the C++ step can run this linear layer for a model of `dtype`."""
    if isinstance(layer, PanelLinear):
        return layer.panels.dtype == dtype
    return isinstance(layer, BlockQuantLinear) and dtype == torch.float32


def fused_decoder_for(
    model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> FusedDecoder | None:
    """The C++ decoder of `model`, or None where it does not apply (another architecture,
    activation, dtype or device, linear layers it cannot call, tensor-parallel shards, no C++
    kernels)."""
    kernels = cpu_kernels()
    if (
        kernels is None
        or get_tp_group().size > 1  # the C++ step has no all-reduce between its layers
        or device.type != "cpu"
        or dtype not in (torch.float32, torch.bfloat16)
        or config.architecture != "llama"
        or config.hidden_act != "silu"
        or not all(_callable(m, dtype) for m in model.modules() if _is_projection(m))
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
    blocked = any(isinstance(m, BlockQuantLinear) for m in model.model.layers.modules())
    return FusedDecoder(kernels.LlamaDecoder(
        config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
        model.lm_head.out_features, config.norm_eps, model.model.norm.weight.detach(), _linear(model.lm_head), layers,
    ), model.model.embed_tokens, model.rotary, MAX_BLOCKED_BATCH if blocked else None)


class FusedDecoder:
    """The C++ step, fed the model's own token embeddings (the table may be stored as 8-bit
    blocks, see layers/parallel.py) and rotary angles: with the same cos/sin and the same rotation
    code (cpu_kernels.h) the two paths rotate q and k alike."""

    def __init__(self, decoder: Any, embedding: nn.Module, rotary: RotaryEmbedding, max_batch: int | None) -> None:
        self.decoder = decoder
        self.embedding = embedding
        self.rotary = rotary
        self.max_batch = max_batch  # None: any batch

    def serves(self, num_decodes: int) -> bool:
        """Whether a step of `num_decodes` decoding requests (and nothing else) runs here."""
        return self.max_batch is None or num_decodes <= self.max_batch

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """One decode step for every row: logits [rows, vocabulary]."""
        rotations = torch.view_as_real(self.rotary.rotations(positions))
        embedded = self.embedding(token_ids)
        return self.decoder.forward(embedded, rotations, slot_mapping, block_tables, context_lens, kv_caches)


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | BlockQuantLinear | PrepackedLinear | PanelLinear)
