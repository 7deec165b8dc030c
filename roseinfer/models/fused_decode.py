"""Decode steps of a Llama-family model in one C++ call (layers/csrc/llama_decode_cpu.cpp).

Run op by op, a decode step is ~400 PyTorch operations, and at small batches their dispatch costs
as much as their arithmetic (a 30-layer model: ~5 ms a token). The C++ step applies to CPU models
whose linear layers it can call directly: float32 or bfloat16 weights on the panel kernel (CPUs
with AVX-512 and no AMX), and GGUF blocks of any type (`BlockLinear`). It holds references to the
model's own tensors (no copies) and computes what the model computes, with the same row functions
and linear kernels, up to summation order; the model runner uses it for steps that are all decodes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.layers.linear import BlockLinear, PanelLinear, PrepackedLinear
from roseinfer.layers.rotary import RotaryEmbedding
from roseinfer.models.llama import LlamaForCausalLM
from roseinfer.models.phi3 import Phi3ForCausalLM

# A linear layer as the C++ step takes it: (tensors, GGML types, bias, exact); see DecodeLinear in
# layers/csrc/llama_decode_cpu.cpp.
LinearSpec = tuple[list[torch.Tensor], list[int], torch.Tensor | None, bool]


def _linear(layer: nn.Module) -> LinearSpec:
    if isinstance(layer, PanelLinear):
        panels = [layer.panels] + ([layer.panel_bias] if layer.panel_bias is not None else [])
        return panels, [], None, False
    return [p.packed for p in layer.parts], [p.kernel_type for p in layer.parts], layer.bias, layer.exact


def _callable(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the C++ step can run this linear layer for a model of `dtype`."""
    if isinstance(layer, PanelLinear):
        return layer.panels.dtype == dtype
    return isinstance(layer, BlockLinear)


def fused_decoder_for(
    model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> FusedDecoder | None:
    """The C++ decoder of `model`, or None where it does not apply (another architecture,
    activation, dtype or device, linear layers it cannot call, tensor-parallel shards, no C++
    kernels)."""
    kernels = cpu_kernels()
    windows = {config.layer_window(i) for i in range(config.num_layers)}
    if (
        # Only the Llama family itself and Phi-3 (the Llama decoder once loaded, models/phi3.py: its
        # partial and LongRoPE rotary are in the rotations computed here, which the C++ step
        # applies). Gemma (extra norms, GeGLU, soft-caps, two rotary bases) subclasses Llama too,
        # but the C++ step does not compute it: refused by type as well.
        config.architecture not in ("llama", "phi3")
        or type(model) not in (LlamaForCausalLM, Phi3ForCausalLM)
        or len(windows) > 1  # the C++ step takes one sliding window for every layer
        or kernels is None
        or get_tp_group().size > 1  # the C++ step has no all-reduce between its layers
        or device.type != "cpu"
        or dtype not in (torch.float32, torch.bfloat16)
        or config.moe is not None  # the C++ step has no router or experts
        or config.hidden_act != "silu"
        or not all(_callable(m, dtype) for m in model.modules() if _is_projection(m))
    ):
        return None
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append((
            layer.input_layernorm.weight.detach(),
            attn.q_norm.weight.detach() if attn.qk_norm else None,
            attn.k_norm.weight.detach() if attn.qk_norm else None,
            layer.post_attention_layernorm.weight.detach(),
            _linear(attn.qkv_proj), _linear(attn.o_proj), _linear(mlp.gate_up_proj), _linear(mlp.down_proj),
        ))
    return FusedDecoder(kernels.LlamaDecoder(
        config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
        model.lm_head.out_features, config.norm_eps, model.model.norm.weight.detach(), _linear(model.lm_head), layers,
        windows.pop() or 0,
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
                block_tables: torch.Tensor, context_lens: torch.Tensor, kv_caches: list[torch.Tensor],
                long_rope: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for every row: logits [rows, vocabulary] (`long_rope`: see AttentionMetadata)."""
        rotations = torch.view_as_real(self.rotary.rotations(positions, long_rope))
        embedded = self.embedding(token_ids)
        return self.decoder.forward(embedded, rotations, slot_mapping, block_tables, context_lens, kv_caches)


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | BlockLinear | PrepackedLinear | PanelLinear)
