"""Decode steps of a pre-norm decoder in one C++ call (layers/csrc/decoder_step_cpu.cpp), built
from the model's own description of itself.

Run op by op, a decode step is ~400 PyTorch operations, and at small batches their dispatch costs
as much as their arithmetic (a 30-layer model: ~5 ms a token). A model class that can be run this
way says so with `fused_decode_spec()`, returning a `DecodeModelSpec`: its layers, one
`DecodeLayerSpec` each, built from the same modules its forward runs, so the two cannot drift. A
layer is its attention core (norms, projections, attention parameters, rotary table) and the
features it has, each one object or field: a sliding window and a soft-cap of the scores (in its
attention parameters), norms of q and k (`QKNorm`), norms of the sub-layers' outputs
(`PostNorms`), and its MLP, gated (`GatedMLPSpec`) or a mixture of experts (`DecodeExpertsSpec`);
the C++ step has one setter per feature, not flags of a family. This module builds the C++ step
from that description only (never from the attributes of an arbitrary class) and refuses, by
name and logged once, what the C++ step does not compute (another activation, shapes or norm eps
differing between layers, ...) or cannot call (linear layers other than float panels or GGUF
blocks, tensor-parallel shards, another device). A model without the method, or returning None,
keeps its op-by-op forward. Per model the step takes an embedding scale and a soft-cap of the
final logits. The Llama family, Qwen2/3, Gemma 2/3 and the mixtures of experts describe themselves.

The C++ step applies to CPU models whose linear layers it can call directly: float32 or bfloat16
weights on the panel kernel (CPUs with AVX-512 and no AMX), and GGUF blocks of any type
(`BlockLinear`). It holds references to the model's own tensors (no copies) and computes what the
model computes, with the same row functions and linear kernels, up to summation order; the model
runner uses it for steps that are all decodes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roseinfer.common.kv_cache_spec import layer_kv_groups
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.layers.attention import AttentionLayerParams
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.layers.linear import BlockLinear, PanelLinear
from roseinfer.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

# A linear layer as the C++ step takes it: (tensors, GGML types, bias, exact); see DecodeLinear in
# layers/csrc/decoder_step_cpu.cpp.
LinearSpec = tuple[list[torch.Tensor], list[int], torch.Tensor | None, bool]


@dataclass(frozen=True)
class DecodeExpertsSpec:
    """A mixture-of-experts MLP (models/moe.py): softmax over the router's logits in float32, each
    row's `top_k` experts weighted by their probabilities (renormalised to sum to 1 where
    `normalize_top_k`), each expert a SwiGLU FFN; Qwen2-MoE adds a shared expert times the sigmoid
    of its gate."""

    router: nn.Module  # [experts, hidden]
    gate_up_projs: tuple[nn.Module, ...]  # per expert: gate rows, then up rows
    down_projs: tuple[nn.Module, ...]
    top_k: int
    normalize_top_k: bool
    intermediate_size: int  # each expert's
    shared_gate_up_proj: nn.Module | None = None
    shared_down_proj: nn.Module | None = None
    shared_gate: nn.Module | None = None  # [1, hidden]
    shared_intermediate_size: int = 0

    def linears(self) -> dict[str, nn.Module]:
        """Every linear layer, by a name for messages."""
        named = {"router": self.router}
        for index, (gate_up, down) in enumerate(zip(self.gate_up_projs, self.down_projs, strict=True)):
            named[f"expert {index} gate_up_proj"] = gate_up
            named[f"expert {index} down_proj"] = down
        if self.shared_intermediate_size:
            named |= {"shared_expert.gate_up_proj": self.shared_gate_up_proj,
                      "shared_expert.down_proj": self.shared_down_proj, "shared_expert_gate": self.shared_gate}
        return named


@dataclass(frozen=True)
class GatedMLPSpec:
    """A gated MLP: down_proj(activation(gate) * up), gate and up rows in one matrix."""

    gate_up_proj: nn.Module  # gate rows, then up rows
    down_proj: nn.Module
    intermediate_size: int
    activation: str = "silu"  # of the gate: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)


@dataclass(frozen=True)
class QKNorm:
    """RMSNorms of q and of k after the projection, before rotary: one per head (Qwen3, Gemma 3),
    or with `over_all_heads` one over the whole of q and one over the whole of k (OLMoE)."""

    q: torch.Tensor
    k: torch.Tensor
    over_all_heads: bool = False


@dataclass(frozen=True)
class PostNorms:
    """RMSNorms of the attention's and the MLP's outputs, before their residual adds (Gemma)."""

    attention: torch.Tensor
    mlp: torch.Tensor


@dataclass(frozen=True)
class DecodeLayerSpec:
    """One pre-norm decoder layer, as its model computes it (RMSNorms throughout):

        a = o_proj(attention(rope(qk_norm(qkv_proj(input_norm(x))))))    (no qk_norm: as is)
        h = x + post_norms.attention(a)                                   (no post_norms: x + a)
        y = h + post_norms.mlp(mlp(mlp_norm(h)))

    `attention` carries the scores' scale, sliding window and soft-cap; `mlp` is gated or a
    mixture of experts.
    """

    input_norm: torch.Tensor  # RMSNorm weights, as the model applies them
    qkv_proj: nn.Module  # q, k and v rows in one matrix (q/k rows in the rotary layout)
    o_proj: nn.Module
    mlp_norm: torch.Tensor
    mlp: GatedMLPSpec | DecodeExpertsSpec
    attention: AttentionLayerParams  # heads, scale, sliding window, soft-cap
    rotary: RotaryEmbedding  # the table this layer's q and k rotate with
    norm_eps: float  # of every RMSNorm of the layer
    qk_norm: QKNorm | None = None
    post_norms: PostNorms | None = None


@dataclass(frozen=True)
class DecodeModelSpec:
    """A whole decoder: token embeddings (times `embedding_scale`), the layers, the final RMSNorm
    and the LM head (its logits soft-capped by `final_logit_softcap`)."""

    embedding: nn.Module  # token ids -> hidden rows (the model's own table module)
    layers: tuple[DecodeLayerSpec, ...]
    final_norm: torch.Tensor
    norm_eps: float
    lm_head: nn.Module
    hidden_size: int
    embedding_scale: float | None = None  # Gemma: sqrt(hidden_size)
    final_logit_softcap: float | None = None  # Gemma 2


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


# The gated MLP activations the C++ step computes (GatedMLPSpec.activation).
ACTIVATIONS = ("silu", "gelu_tanh")


def unsupported(spec: DecodeModelSpec, dtype: torch.dtype) -> str | None:
    """What in `spec` the C++ step does not compute or cannot call, or None where it runs all of it."""
    if spec.embedding_scale is not None and not spec.embedding_scale > 0:
        return f"embedding scale {spec.embedding_scale} (the C++ step scales by a positive factor)"
    first = spec.layers[0]
    for index, layer in enumerate(spec.layers):
        where = f"layer {index}: "
        attention, mlp = layer.attention, layer.mlp
        if isinstance(mlp, GatedMLPSpec) and mlp.activation not in ACTIVATIONS:
            return where + f"activation {mlp.activation!r} (the C++ step has {', '.join(ACTIVATIONS)})"
        if not attention.scale > 0:
            return where + f"attention scale {attention.scale} (the C++ step takes a positive scale)"
        # The C++ step takes one of each of these for the whole model.
        if (attention.num_heads, attention.num_kv_heads, attention.head_dim) != (
            first.attention.num_heads, first.attention.num_kv_heads, first.attention.head_dim,
        ):
            return where + "its shapes differ from layer 0's"
        if layer.norm_eps != spec.norm_eps:
            return where + "its norms' eps differs from the final norm's"
        linears = {"qkv_proj": layer.qkv_proj, "o_proj": layer.o_proj}
        if isinstance(mlp, GatedMLPSpec):
            linears |= {"gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}
        else:
            linears |= mlp.linears()
        for name, linear in linears.items():
            if not _callable(linear, dtype):
                return where + f"{name} is a {type(linear).__name__} the C++ step cannot call for {dtype}"
    if not _callable(spec.lm_head, dtype):
        return f"the LM head is a {type(spec.lm_head).__name__} the C++ step cannot call for {dtype}"
    return None


_logged: set[str] = set()


def _refuse(model: nn.Module, reason: str) -> None:
    message = f"no fused C++ decode step for {type(model).__name__}: {reason}; decoding op by op"
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def fused_decoder_for(model: nn.Module, dtype: torch.dtype, device: torch.device) -> FusedDecoder | None:
    """The C++ decoder of `model` from its `fused_decode_spec()`, or None (logged once, with the
    reason) where the model describes none or the C++ step cannot run what it describes."""
    describe = getattr(model, "fused_decode_spec", None)
    spec: DecodeModelSpec | None = describe() if describe is not None else None
    kernels = cpu_kernels()
    if spec is None:
        reason = "the model describes no fused decode step"
    elif kernels is None:
        reason = "the C++ kernels could not be built"
    elif get_tp_group().size > 1:
        reason = "tensor parallelism (the C++ step has no all-reduce between its layers)"
    elif device.type != "cpu":
        reason = f"device {device} (the C++ step runs on the CPU)"
    elif dtype not in (torch.float32, torch.bfloat16):
        reason = f"dtype {dtype} (the C++ step takes float32 or bfloat16)"
    else:
        reason = unsupported(spec, dtype)
    if reason is not None:
        _refuse(model, reason)
        return None
    rotaries: list[RotaryEmbedding] = []  # the distinct tables (Gemma 3: local and global)
    for layer in spec.layers:
        if not any(layer.rotary is table for table in rotaries):
            rotaries.append(layer.rotary)
    # The embeddings' factor rounded to the activations' dtype first, as Gemma's forward rounds it.
    scale = torch.tensor(spec.embedding_scale, dtype=dtype).item() if spec.embedding_scale is not None else 0.0
    attention = spec.layers[0].attention
    decoder = kernels.DecoderStep(
        spec.hidden_size, attention.num_heads, attention.num_kv_heads, attention.head_dim, spec.lm_head.out_features,
        spec.norm_eps, spec.final_norm, _linear(spec.lm_head), scale,
    )
    # A model with full and sliding layers keeps a pool per kind, read through its own block
    # tables and slots (common/kv_cache_spec.py): each layer names its group.
    groups = layer_kv_groups([layer.attention.sliding_window for layer in spec.layers])
    for layer, group in zip(spec.layers, groups, strict=True):
        _add_layer(decoder, layer, next(i for i, table in enumerate(rotaries) if table is layer.rotary), group)
    return FusedDecoder(decoder, spec.embedding, rotaries, spec.final_logit_softcap)


def _add_layer(decoder: Any, layer: DecodeLayerSpec, rotary: int, kv_group: int) -> None:
    """The layer's attention core, then one setter per feature it has (DecoderStep in
    layers/csrc/decoder_step_cpu.cpp)."""
    attention = layer.attention
    index = decoder.add_layer(layer.input_norm, _linear(layer.qkv_proj), _linear(layer.o_proj), layer.mlp_norm,
                              attention.scale, rotary)
    if kv_group:
        decoder.set_kv_group(index, kv_group)
    if attention.sliding_window:
        decoder.set_sliding_window(index, attention.sliding_window)
    if attention.softcap:
        decoder.set_score_softcap(index, attention.softcap)
    if layer.qk_norm is not None:
        decoder.set_qk_norm(index, layer.qk_norm.q, layer.qk_norm.k, layer.qk_norm.over_all_heads)
    if layer.post_norms is not None:
        decoder.set_post_norms(index, layer.post_norms.attention, layer.post_norms.mlp)
    mlp = layer.mlp
    if isinstance(mlp, GatedMLPSpec):
        decoder.set_gated_mlp(index, _linear(mlp.gate_up_proj), _linear(mlp.down_proj), mlp.intermediate_size,
                              mlp.activation)
    else:
        _set_experts(decoder, index, mlp)


def _set_experts(decoder: Any, index: int, experts: DecodeExpertsSpec) -> None:
    shared = None
    if experts.shared_intermediate_size:
        shared = (_linear(experts.shared_gate_up_proj), _linear(experts.shared_down_proj),
                  _linear(experts.shared_gate), experts.shared_intermediate_size)
    decoder.set_experts(
        index, _linear(experts.router), [_linear(m) for m in experts.gate_up_projs],
        [_linear(m) for m in experts.down_projs], experts.top_k, experts.normalize_top_k,
        experts.intermediate_size, shared,
    )


class FusedDecoder:
    """The C++ step, fed the model's own token embeddings (the table may be stored as 8-bit
    blocks, see layers/parallel.py) and rotary angles, one set per distinct table: with the same
    cos/sin and the same rotation code (cpu_kernels.h) the two paths rotate q and k alike. The
    final logits' soft-cap (Gemma 2) is applied here as the model's compute_logits applies it:
    three elementwise ops, rounded alike in the logits' dtype."""

    def __init__(self, decoder: Any, embedding: nn.Module, rotaries: list[RotaryEmbedding],
                 final_logit_softcap: float | None = None) -> None:
        self.decoder = decoder
        self.embedding = embedding
        self.rotaries = rotaries
        self.final_logit_softcap = final_logit_softcap

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor | list[torch.Tensor], block_tables: torch.Tensor | list[torch.Tensor],
                context_lens: torch.Tensor, kv_caches: list[torch.Tensor],
                long_rope: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for every row: logits [rows, vocabulary] (`long_rope`: see AttentionMetadata).
        Slots and block tables: one tensor of each, or with KV cache groups a list, one per group."""
        rotations = [torch.view_as_real(rotary.rotations(positions, long_rope)) for rotary in self.rotaries]
        embedded = self.embedding(token_ids)
        if isinstance(slot_mapping, torch.Tensor):
            slot_mapping, block_tables = [slot_mapping], [block_tables]
        logits = self.decoder.forward(embedded, rotations, slot_mapping, block_tables, context_lens, kv_caches)
        cap = self.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
