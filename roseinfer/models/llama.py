"""The Llama family in plain PyTorch: Llama, Mistral, SmolLM, Qwen2 (q/k/v biases), Qwen3 (q/k norms).

Parameters use Hugging Face names, except that q/k/v and gate/up are each fused into one matrix
(fewer, larger matrix products); `load_weights` does the fusing. Under tensor parallelism (see
layers/parallel.py) each rank builds only its heads, MLP columns and vocabulary rows, and
`load_weights` takes only its slice of each checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.distributed.partition import partition
from roseinfer.errors import ModelLoadError
from roseinfer.layers.activation import silu_and_mul
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.parallel import take_shard
from roseinfer.layers.rotary import RotaryEmbedding, apply_rotary, interleave_rotary_rows
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.decoder import DecoderBackbone, DecoderForCausalLM, DecoderLayer
from roseinfer.models.fused_decode import (
    DecodeExpertsSpec,
    DecodeLayerSpec,
    DecodeModelSpec,
    GatedMLPSpec,
    PostNorms,
    QKNorm,
)
from roseinfer.models.weights import ModuleLoaded, WeightLoader


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.tp = get_tp_group()
        # This rank's KV heads, and the query heads that share them.
        first_kv_head, self.num_kv_heads = partition(config.num_kv_heads, self.tp.size, self.tp.rank)
        group = config.num_heads // config.num_kv_heads
        self.num_heads = self.num_kv_heads * group
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.q_start = first_kv_head * group * config.head_dim  # rows of the checkpoint's q_proj
        self.kv_start = first_kv_head * config.head_dim  # rows of its k_proj and v_proj
        self.qkv_proj = nn.Linear(  # column-parallel
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)  # row-parallel
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, config.head_dim, config.head_dim**-0.5,
                                   sliding_window=config.layer_window(layer))

    def forward(
        self,
        hidden: torch.Tensor,
        rotations: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, rotations), apply_rotary(k, rotations)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.tp.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.start, self.intermediate_size = partition(config.intermediate_size, self.tp.size, self.tp.rank)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)  # column-parallel
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)  # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(DecoderLayer):
    """Llama's attention and SwiGLU MLP in the shared pre-norm layer (models/decoder.py)."""

    def make_attention(self, config: ModelConfig, layer: int) -> nn.Module:
        return LlamaAttention(config, layer)

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return LlamaMLP(config)


class LlamaBackbone(DecoderBackbone):
    layer_class = LlamaDecoderLayer


# Checkpoint modules whose rows are query or key heads, put in the rotary layout at load -> the
# config's count of their heads (None: one head's width, a per-head q/k norm).
_ROTATED_HEADS = {"q_proj": "num_heads", "k_proj": "num_kv_heads", "q_norm": None, "k_norm": None,
                  "q_norm_full": "num_heads", "k_norm_full": "num_kv_heads"}
# Checkpoint modules cut by heads under tensor parallelism -> (dim, start, size) of this rank's part,
# from the attention module that holds them.
_HEAD_ROWS = {
    "q_proj": lambda attn: (0, attn.q_start, attn.q_size),
    "k_proj": lambda attn: (0, attn.kv_start, attn.kv_size),
    "v_proj": lambda attn: (0, attn.kv_start, attn.kv_size),
    "o_proj": lambda attn: (1, attn.q_start, attn.q_size),
    "q_norm_full": lambda attn: (0, attn.q_start, attn.q_size),  # OLMoE's norms span all heads
    "k_norm_full": lambda attn: (0, attn.kv_start, attn.kv_size),
}
# MLP modules (dense, an expert's, a shared expert's) -> the dim their owner's columns are cut along.
_MLP_ROWS = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}
# Checkpoint modules that are row blocks of one fused matrix -> that matrix's module.
_FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


# What LlamaForCausalLM's step runs around its layers: a subclass that changes one computes
# something the fused step does not, unless it describes itself.
_STEP_METHODS = ("forward", "embed_input_ids", "layer_rotations", "compute_logits")


def runs_llama_step(model: nn.Module) -> bool:
    return all(getattr(type(model), name) is getattr(LlamaForCausalLM, name) for name in _STEP_METHODS)


def _first_row(owner: nn.Module, module: str) -> int:
    """Where a fused part's rows start in its matrix (`owner`: the attention or MLP holding it)."""
    if module in ("gate_proj", "up_proj"):
        return 0 if module == "gate_proj" else owner.intermediate_size
    return {"q_proj": 0, "k_proj": owner.q_size, "v_proj": owner.q_size + owner.kv_size}[module]


# llama.cpp's tensor names -> Hugging Face's: per layer (blk.N.<name>) and outside the layers.
LLAMA_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def decode_layer_spec(
    layer: nn.Module, mlp_norm: RMSNorm, rotary: RotaryEmbedding, activation: str,
    experts: DecodeExpertsSpec | None = None, post_norms: PostNorms | None = None,
) -> DecodeLayerSpec:
    """One decoder layer of the Llama layout (input norm, fused qkv, o, optional q/k norms per
    head, fused gate/up, down; Gemma's layers too) as the fused decode step reads it; `experts`: a
    mixture-of-experts MLP in place of gate/up and down; `post_norms`: norms of the attention's and
    the MLP's outputs (Gemma)."""
    attention = layer.self_attn
    mlp = experts
    if mlp is None:
        mlp = GatedMLPSpec(layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.intermediate_size, activation)
    qk_norm = None
    if attention.qk_norm:
        qk_norm = QKNorm(attention.q_norm.weight.detach(), attention.k_norm.weight.detach())
    return DecodeLayerSpec(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv_proj=attention.qkv_proj,
        o_proj=attention.o_proj,
        mlp_norm=mlp_norm.weight.detach(),
        mlp=mlp,
        attention=attention.attn.params,
        rotary=rotary,
        norm_eps=layer.input_layernorm.eps,
        qk_norm=qk_norm,
        post_norms=post_norms,
    )


class LlamaForCausalLM(DecoderForCausalLM):
    # The checkpoints this class reads, for the loaders (models/registry.py gathers them): Hugging
    # Face model_type and GGUF general.architecture -> the architecture name of the registry.
    hf_model_types: ClassVar[dict[str, str]] = {
        "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    }
    gguf_architectures: ClassVar[dict[str, str]] = {
        "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    }
    gguf_layer_prefix: ClassVar[str] = "model.layers"
    gguf_layer_names: ClassVar[dict[str, str]] = LLAMA_GGUF_LAYER_NAMES
    gguf_global_names: ClassVar[dict[str, str]] = LLAMA_GGUF_GLOBAL_NAMES
    backbone_class = LlamaBackbone

    def fused_decode_spec(self) -> DecodeModelSpec | None:
        """This model's decode step as a fused decoder computes it (models/fused_decode.py): what
        `forward` runs, layer by layer. None for a subclass that changes the forward, the logits
        or a layer's class without describing itself: it must not inherit Llama's description."""
        if not runs_llama_step(self):
            return None
        if not all(type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
                   and type(layer.mlp) is LlamaMLP for layer in self.model.layers):
            return None
        return DecodeModelSpec(
            embedding=self.model.embed_tokens,
            layers=tuple(
                decode_layer_spec(layer, layer.post_attention_layernorm, self.rotary, "silu")
                for layer in self.model.layers
            ),
            final_norm=self.model.norm.weight.detach(),
            norm_eps=self.model.norm.eps,
            lm_head=self.lm_head,
            hidden_size=self.config.hidden_size,
        )

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], on_module_loaded: ModuleLoaded | None = None
    ) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up into their shared matrices
        and putting q/k rows (and q/k norms) in the interleaved rotary layout; with tensor
        parallelism, only this rank's slice of each. The families built on Llama's layers (MoE,
        gpt-oss) load through this loop, naming their tensors as Llama's (`checkpoint_tensors`)."""
        loader = WeightLoader(self, on_module_loaded)
        for name, tensor in self.checkpoint_tensors(weights):
            if self.skips_tensor(name):
                continue
            parts = name.split(".")
            module = parts[-2] if len(parts) > 1 else ""
            if module:
                tensor = self.this_ranks_part(parts, self.rotary_layout(module, tensor))
            fused = _FUSED_INTO.get(module)
            if fused is None:
                loader.load(name, tensor)
            else:
                first = _first_row(self.owner_of(parts), module)
                loader.load_rows(".".join([*parts[:-2], fused, parts[-1]]), tensor, first)
        self.finish_load(loader, self.model.embed_tokens)

    def owner_of(self, parts: list[str]) -> nn.Module:
        """The module that holds a checkpoint tensor's module (its attention, its MLP)."""
        try:
            return self.get_submodule(".".join(parts[:-2]))
        except AttributeError:
            raise ModelLoadError(f"the checkpoint has a tensor {'.'.join(parts)!r} that the model does not use") from None

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's tensors under the names this loop knows (a family's spellings mapped)."""
        return weights

    def rotary_layout(self, module: str, tensor: Any) -> Any:
        """q/k rows (and q/k norms) in the interleaved rotary layout."""
        if module not in _ROTATED_HEADS:
            return tensor
        heads = _ROTATED_HEADS[module]
        return interleave_rotary_rows(tensor, getattr(self.config, heads) if heads else 1, self.config.rotary_dim)

    def this_ranks_part(self, parts: list[str], tensor: Any) -> Any:
        """This rank's slice of a full checkpoint tensor (the whole tensor on one rank)."""
        module = parts[-2]
        if ".".join(parts) in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.vocab.of(tensor)
        owner = None
        if module in _HEAD_ROWS or module in _MLP_ROWS:
            owner = self.get_submodule(".".join(parts[:-2]))
        if module in _HEAD_ROWS:
            dim, start, size = _HEAD_ROWS[module](owner)
            if tensor.dim() == 1 and dim == 1:
                return tensor  # a row-parallel projection's bias (gpt-oss's o_proj, one rank only)
            # A 1-D tensor here is a q/k/v bias (Qwen2) or a norm over all heads (OLMoE): cut like its rows.
            return take_shard(tensor, dim if tensor.dim() == 2 else 0, start, size)
        if module in _MLP_ROWS:
            return take_shard(tensor, _MLP_ROWS[module], owner.start, owner.intermediate_size)
        return tensor

    # -- reading a checkpoint's config (models/hf_config.py and gguf_loader.py dispatch here) --

    # Hugging Face model_type -> (attention biases, per-head q/k norms), where not Llama's (neither).
    hf_attention_defaults: ClassVar[dict[str, tuple[bool, bool]]] = {"qwen2": (True, False), "qwen3": (False, True)}

    @classmethod
    def hf_rope(cls, source: HFConfigSource) -> tuple[float, dict[str, Any] | None, float]:
        """rope_theta, scaling and partial rotary factor of the family's config.json."""
        return source.rope()

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        default_bias, qk_norm = cls.hf_attention_defaults.get(source.model_type, (False, False))
        fields = source.decoder_fields()
        theta, scaling, partial_rotary = cls.hf_rope(source)
        sliding = raw.get("sliding_window")
        layer_types = raw.get("layer_types")
        if source.model_type == "qwen2":
            if not raw.get("use_sliding_window", False):
                sliding = None
            elif layer_types is None:  # as transformers: layers from max_window_layers on slide
                first = raw.get("max_window_layers", 28)
                layer_types = ["sliding_attention" if i >= first else "full_attention"
                               for i in range(raw["num_hidden_layers"])]
        return source.build(
            **fields,
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=raw.get("attention_bias", default_bias),
            qk_norm=qk_norm,
            hidden_act=raw.get("hidden_act", "silu"),
            sliding_window=sliding,
            layer_types=layer_types if sliding else None,
            rotary_dim=int(fields["head_dim"] * partial_rotary) if partial_rotary != 1.0 else None,
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        fields = source.attention_fields()
        head_dim, rotary_dim = fields["head_dim"], source.get("rope.dimension_count")
        return source.build(
            **fields,
            rope_theta=float(source.key("rope.freq_base", 10000.0)),
            rope_scaling=source.rope_scaling(),
            rotary_dim=int(rotary_dim) if rotary_dim is not None and int(rotary_dim) != head_dim else None,
            attention_bias=source.gguf.has_tensor("blk.0.attn_q.bias"),
            qk_norm=source.gguf.has_tensor("blk.0.attn_q_norm.weight"),
            # Phi-3's converter writes 0 for "none" (Phi-4).
            sliding_window=source.get("attention.sliding_window") or None,
        )
