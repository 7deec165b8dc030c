"""Mixture-of-experts decoders in plain PyTorch: Mixtral, Qwen2-MoE (with its shared expert),
Qwen3-MoE, OLMoE. Attention and the block layout are the Llama family's (models/llama.py); the
MLP of each sparse layer is a router and `num_experts` SwiGLU experts, of which each token runs
`top_k`.

Each expert is its own pair of linear layers (fused gate/up, down), so the linear-layer machinery
(layers/linear.py) gives each the kernel of its weight's format: a GGUF file's 3-D `ffn_*_exps`
tensors are cut into one `BlockTensor` per expert and run in their own blocks, with no float copy.
The tokens of a step are grouped by the expert they chose and each chosen expert runs one matrix
product over its group, so a decode step reads only the weights of the experts its tokens chose.
Decode steps run in the fused C++ step (models/fused_decode.py: `SparseMoeBlock.decode_spec`),
which routes and groups the same way and, on GGUF blocks, runs all the chosen experts' products in
one parallel region instead of one per expert.

Under tensor parallelism (layers/parallel.py) every FFN is cut as the dense Llama MLP is: each
rank holds its columns of every expert's (and the shared expert's) gate/up and the matching rows of
its down projection. The router is replicated and every all-reduce leaves the same sum on every
rank, so every rank routes a token to the same experts; each rank adds up its partial expert
outputs, and the whole block (experts and shared expert) is summed across ranks with one all-reduce. OLMoE's q/k norms over all heads take the sum of squares
of every rank's heads (one more all-reduce, of two numbers per token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig, MoeConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.distributed.partition import partition
from roseinfer.errors import ModelLoadError
from roseinfer.layers.activation import silu_and_mul
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.rotary import apply_rotary
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.fused_decode import DecodeExpertsSpec, DecodeModelSpec, QKNorm
from roseinfer.models.llama import (
    LLAMA_GGUF_LAYER_NAMES,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    decode_layer_spec,
    runs_llama_step,
)


class GatedMLP(nn.Module):
    """One SwiGLU FFN (an expert, a shared expert or a dense layer's MLP): this rank's columns of
    gate/up (column-parallel) and rows of down (row-parallel), as LlamaMLP. `reduce`: sum the ranks'
    partial outputs here (a dense layer); an expert's are left to its MoE block, which sums once."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce: bool = False) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.reduce = reduce
        self.start, self.intermediate_size = partition(intermediate_size, self.tp.size, self.tp.rank)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return self.tp.all_reduce(out) if self.reduce else out


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert behind a sigmoid gate)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.tp = get_tp_group()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, moe.intermediate_size) for _ in range(moe.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(config.hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] in x's dtype, expert ids [tokens, top_k]): softmax over all
        experts in float32, the top k, renormalised to sum to 1 where the model does. (Mixtral's
        softmax over its top-k logits is the same thing.)"""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def decode_spec(self) -> DecodeExpertsSpec:
        """This block as the fused decode step computes it (models/fused_decode.py)."""
        shared = self.shared_expert
        return DecodeExpertsSpec(
            router=self.gate,
            gate_up_projs=tuple(expert.gate_up_proj for expert in self.experts),
            down_projs=tuple(expert.down_proj for expert in self.experts),
            top_k=self.top_k,
            normalize_top_k=self.norm_topk_prob,
            intermediate_size=self.experts[0].intermediate_size,
            shared_gate_up_proj=shared.gate_up_proj if shared is not None else None,
            shared_down_proj=shared.down_proj if shared is not None else None,
            shared_gate=self.shared_expert_gate if shared is not None else None,
            shared_intermediate_size=shared.intermediate_size if shared is not None else 0,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        # Group the (token, slot) pairs by expert: one matrix product per expert that was chosen,
        # in expert order, each adding its weighted output into its tokens' rows.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k
        weight_of = weights.flatten()[order]
        start = 0
        for expert_id, count in enumerate(counts):
            if not count:
                continue
            tokens = token_of[start:start + count]
            y = self.experts[expert_id](x.index_select(0, tokens))
            out.index_add_(0, tokens, y * weight_of[start:start + count, None])
            start += count
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)  # one sum across ranks for every expert's partial output


class FullWidthQKNormAttention(LlamaAttention):
    """OLMoE's attention: one RMSNorm over the whole of q (all heads) and one over the whole of k,
    before the heads are split, where Qwen3 normalises each head. Under tensor parallelism each
    rank holds its heads' part of the norms' weights; the mean square is over all heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(dataclasses.replace(config, qk_norm=False))
        self.q_norm_full = RMSNorm(self.q_size, config.norm_eps)
        self.k_norm_full = RMSNorm(self.kv_size, config.norm_eps)
        self.full_widths = (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim)

    def _norm_q_k(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp.size == 1:
            return self.q_norm_full(q.contiguous()), self.k_norm_full(k.contiguous())
        # Each rank's sums of squares over its heads, summed across ranks: q's and k's in one all-reduce.
        q32, k32 = q.float(), k.float()
        sums = self.tp.all_reduce(torch.stack([q32.square().sum(-1), k32.square().sum(-1)], dim=-1))
        scales = torch.rsqrt(sums / sums.new_tensor(self.full_widths) + self.q_norm_full.eps)
        q = (q32 * scales[:, :1] * self.q_norm_full.weight.float()).to(q.dtype)
        k = (k32 * scales[:, 1:] * self.k_norm_full.weight.float()).to(k.dtype)
        return q, k

    def forward(
        self, hidden: torch.Tensor, rotations: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_q_k(q, k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rotations), apply_rotary(k, rotations)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.tp.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))


# Checkpoint spellings -> ours ("mlp.experts.{e}.{gate,up,down}_proj", "mlp.gate").
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _canonical_names(
    weights: Iterable[tuple[str, object]],
) -> Iterator[tuple[str, object]]:
    """Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` and transformers 5's stacked
    `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I] as one tensor per
    expert under Qwen/OLMoE names."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3].isdigit() and parts[-4:-3] == ["experts"] and parts[-2] in _MIXTRAL_EXPERT:
            parts[-2] = _MIXTRAL_EXPERT[parts[-2]]
            name = ".".join(parts)
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf in ("gate_up_proj", "down_proj") and isinstance(tensor, torch.Tensor) and tensor.dim() == 3:
            for expert_id in range(tensor.shape[0]):
                if leaf == "down_proj":
                    yield f"{prefix}.experts.{expert_id}.down_proj.weight", tensor[expert_id]
                else:
                    gate, up = tensor[expert_id].chunk(2, dim=0)
                    yield f"{prefix}.experts.{expert_id}.gate_proj.weight", gate
                    yield f"{prefix}.experts.{expert_id}.up_proj.weight", up
            continue
        yield name, tensor


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose MLPs are `SparseMoeBlock`s, except in `moe.dense_layers`."""

    hf_model_types: ClassVar[dict[str, str]] = {
        "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe", "olmoe": "moe",
    }
    # (and a "llama" file with experts: Mixtral; gguf_loader tells it by its expert count)
    gguf_architectures: ClassVar[dict[str, str]] = {"qwen2moe": "moe", "qwen3moe": "moe", "olmoe": "moe"}
    # The router, Qwen2-MoE's shared expert and its gate.
    gguf_layer_names: ClassVar[dict[str, str]] = {
        **LLAMA_GGUF_LAYER_NAMES,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    }
    # The experts' 3-D [experts, rows, columns] tensors -> the per-expert projections they hold.
    gguf_expert_tensors: ClassVar[dict[str, tuple[str, ...]]] = {
        "ffn_gate_exps": ("gate_proj",),
        "ffn_up_exps": ("up_proj",),
        "ffn_down_exps": ("down_proj",),
        "ffn_gate_up_exps": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: ModelConfig) -> None:
        if config.moe is None:
            raise ModelLoadError("a mixture-of-experts model needs its expert configuration (ModelConfig.moe)")
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            if config.qk_norm_full:
                layer.self_attn = FullWidthQKNormAttention(config)
            if index in config.moe.dense_layers:
                layer.mlp = GatedMLP(config.hidden_size, config.intermediate_size, reduce=True)
            else:
                layer.mlp = SparseMoeBlock(config)

    def fused_decode_spec(self) -> DecodeModelSpec | None:
        """Llama's description with each sparse layer's router and experts (and OLMoE's q/k norms
        over all heads); None where a subclass changed the forward, the logits or a layer's class."""
        if not runs_llama_step(self):
            return None
        layers = []
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if type(layer) is not LlamaDecoderLayer or type(attention) not in (LlamaAttention, FullWidthQKNormAttention):
                return None
            if type(mlp) not in (GatedMLP, SparseMoeBlock):
                return None
            experts = mlp.decode_spec() if isinstance(mlp, SparseMoeBlock) else None
            spec = decode_layer_spec(layer, layer.post_attention_layernorm, self.rotary, "silu", experts=experts)
            if isinstance(attention, FullWidthQKNormAttention):
                spec = dataclasses.replace(spec, qk_norm=QKNorm(
                    attention.q_norm_full.weight.detach(), attention.k_norm_full.weight.detach(), over_all_heads=True,
                ))
            layers.append(spec)
        return DecodeModelSpec(
            embedding=self.model.embed_tokens,
            layers=tuple(layers),
            final_norm=self.model.norm.weight.detach(),
            norm_eps=self.model.norm.eps,
            lm_head=self.lm_head,
            hidden_size=self.config.hidden_size,
        )

    def checkpoint_tensors(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """One tensor per expert (see `_canonical_names`); OLMoE's q/k norms, which span all heads,
        under the names of the norms that hold them (Llama's loop lays them out and cuts them)."""
        for name, tensor in _canonical_names(weights):
            if self.config.qk_norm_full:
                name = name.replace(".q_norm.", ".q_norm_full.").replace(".k_norm.", ".k_norm_full.")
            yield name, tensor

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    # GGUF architectures of a dense family that llama.cpp also writes these models under (Mixtral
    # as `llama`): gguf_loader gives such a file to this class where it counts experts.
    gguf_expert_architectures: ClassVar[dict[str, str]] = {"llama": "moe"}
    # Hugging Face model_type -> (attention biases, per-head q/k norms, whole-q/k norms,
    # renormalise the top-k router weights by default).
    hf_moe_defaults: ClassVar[dict[str, tuple[bool, bool, bool, bool]]] = {
        "mixtral": (False, False, False, True),
        "qwen2_moe": (True, False, False, False),
        "qwen3_moe": (False, True, False, False),
        "olmoe": (False, False, True, False),
    }

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw, model_type = source.raw, source.model_type
        default_bias, qk_norm, qk_norm_full, default_norm_topk = cls.hf_moe_defaults[model_type]
        if raw.get("clip_qkv") is not None:
            raise source.error(f"OLMoE's clip_qkv={raw['clip_qkv']} is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise source.error(f"expert activation {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("use_sliding_window") and model_type != "mixtral":
            raise source.error(f"use_sliding_window is not supported for {model_type}")
        num_layers = raw["num_hidden_layers"]
        # Qwen-MoE: layers listed in mlp_only_layers, or off the decoder_sparse_step grid, are dense.
        step = raw.get("decoder_sparse_step") or 1
        dense = tuple(
            i for i in range(num_layers) if i in (raw.get("mlp_only_layers") or []) or (i + 1) % step
        )
        moe = MoeConfig(
            num_experts=raw.get("num_local_experts") or raw["num_experts"],
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
            norm_topk_prob=True if model_type == "mixtral" else bool(raw.get("norm_topk_prob", default_norm_topk)),
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
            dense_layers=dense,
        )
        theta, scaling, _ = source.rope()
        return source.build(
            **source.decoder_fields(),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=raw.get("qkv_bias", raw.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            qk_norm_full=qk_norm_full,
            hidden_act=raw.get("hidden_act", "silu"),
            sliding_window=raw.get("sliding_window") if model_type == "mixtral" else None,
            moe=moe,
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        """The Llama decoder's keys, then the experts'."""
        config = super().config_from_gguf(source)
        arch, meta, gguf = source.arch, source.metadata, source.gguf
        num_experts = int(source.get("expert_count") or 0)
        if not num_experts:
            raise source.error(f"metadata key {arch}.expert_count is missing")
        if f"{arch}.expert_used_count" not in meta:
            raise source.error(f"metadata key {arch}.expert_used_count is missing")
        # llama.cpp's own choices where the file does not say: Mixtral and Qwen3-MoE renormalise the
        # chosen experts' weights, Qwen2-MoE and OLMoE do not.
        norm_topk = source.get("expert_weights_norm", arch in ("llama", "qwen3moe"))
        shared = 0
        if gguf.has_tensor("blk.0.ffn_up_shexp.weight"):
            shared = gguf.tensor_shape("blk.0.ffn_up_shexp.weight")[0]
        # OLMoE normalises the whole of q and of k (a norm of q's width), Qwen3-MoE each head.
        full_qk_norm = config.qk_norm and gguf.tensor_shape("blk.0.attn_q_norm.weight")[0] != config.head_dim
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=int(meta[f"{arch}.expert_used_count"]),
            intermediate_size=int(source.get("expert_feed_forward_length") or config.intermediate_size),
            norm_topk_prob=bool(norm_topk),
            shared_expert_intermediate_size=shared,
            dense_layers=tuple(
                i for i in range(config.num_layers) if not gguf.has_tensor(f"blk.{i}.ffn_gate_inp.weight")
            ),
        )
        return dataclasses.replace(
            config, moe=moe, qk_norm=config.qk_norm and not full_qk_norm, qk_norm_full=full_qk_norm
        )
