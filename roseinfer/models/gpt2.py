"""GPT-2 in plain PyTorch: learned positions, LayerNorm, fused q/k/v with biases, GELU MLP.

Parameters use Hugging Face's GPT2LMHeadModel names; its Conv1D matrices are stored transposed
(`[in, out]`), so `load_weights` transposes them into `nn.Linear` layout. Under tensor parallelism
(see layers/parallel.py) each rank builds only its heads, MLP columns and vocabulary rows;
`load_weights` takes its slice of each tensor, and the biases of the two row-parallel projections
are added on rank 0 only (the all-reduce would add them once per rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.distributed.partition import partition
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.layers.parallel import VocabParallelEmbedding, take_shard
from roseinfer.layers.quantization import concat_rows
from roseinfer.models.checkpoint_config import GGUFConfigSource, HFConfigSource
from roseinfer.models.decoder import CausalLM
from roseinfer.models.weights import ModuleLoaded, WeightLoader

_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tp = get_tp_group()
        hidden = config.hidden_size
        first_head, self.num_heads = partition(config.num_heads, self.tp.size, self.tp.rank)
        self.head_dim = config.head_dim
        self.attn_start, self.attn_size = first_head * config.head_dim, self.num_heads * config.head_dim
        self.mlp_start, self.mlp_size = partition(config.intermediate_size, self.tp.size, self.tp.rank)
        self.ln_1 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(hidden, 3 * self.attn_size)  # column-parallel
        self.attn.c_proj = nn.Linear(self.attn_size, hidden)  # row-parallel
        self.attn.paged = PagedAttention(self.num_heads, self.num_heads, config.head_dim, config.head_dim**-0.5)
        self.ln_2 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(hidden, self.mlp_size)  # column-parallel
        self.mlp.c_proj = nn.Linear(self.mlp_size, hidden)  # row-parallel
        self.gelu_approximation = _GELU_APPROXIMATION[config.hidden_act]

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        q, k, v = self.attn.c_attn(self.ln_1(hidden)).split(self.attn_size, dim=-1)
        out = self.attn.paged(q.view(shape), k.view(shape), v.view(shape), kv_cache, meta)
        hidden = hidden + self.tp.all_reduce(self.attn.c_proj(out.view(num_tokens, self.attn_size)))
        mlp = F.gelu(self.mlp.c_fc(self.ln_2(hidden)), approximate=self.gelu_approximation)
        return hidden + self.tp.all_reduce(self.mlp.c_proj(mlp))

    def shard(self, suffix: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of one of the block's checkpoint tensors (`suffix` as "attn.c_attn.weight",
        already in nn.Linear layout)."""
        if suffix.startswith("attn.c_attn."):  # [q; k; v] rows: this rank's heads of each
            parts = tensor.split(tensor.shape[0] // 3)
            return concat_rows([take_shard(part, 0, self.attn_start, self.attn_size) for part in parts])
        if suffix == "mlp.c_fc.weight" or suffix == "mlp.c_fc.bias":
            return take_shard(tensor, 0, self.mlp_start, self.mlp_size)
        if suffix == "attn.c_proj.weight":
            return take_shard(tensor, 1, self.attn_start, self.attn_size)
        if suffix == "mlp.c_proj.weight":
            return take_shard(tensor, 1, self.mlp_start, self.mlp_size)
        if suffix in ("attn.c_proj.bias", "mlp.c_proj.bias") and not self.tp.is_first:
            return torch.zeros_like(tensor)  # added once, on rank 0, before the all-reduce
        return tensor


class GPT2Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPT2LMHeadModel(CausalLM):
    hf_model_types: ClassVar[dict[str, str]] = {"gpt2": "gpt2"}
    gguf_architectures: ClassVar[dict[str, str]] = {"gpt2": "gpt2"}
    gguf_layer_prefix: ClassVar[str] = "transformer.h"
    gguf_layer_names: ClassVar[dict[str, str]] = {
        "attn_norm": "ln_1",
        "attn_qkv": "attn.c_attn",
        "attn_output": "attn.c_proj",
        "ffn_norm": "ln_2",
        "ffn_up": "mlp.c_fc",
        "ffn_down": "mlp.c_proj",
    }
    gguf_global_names: ClassVar[dict[str, str]] = {
        "token_embd": "transformer.wte",
        "position_embd": "transformer.wpe",
        "output_norm": "transformer.ln_f",
        "output": "lm_head",
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.transformer = GPT2Backbone(config)
        self.add_lm_head(self.transformer.wte)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block, kv_cache in zip(self.transformer.h, kv_caches, strict=True):
            hidden = block(hidden, kv_cache, meta)
        return self.transformer.ln_f(hidden)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], on_module_loaded: ModuleLoaded | None = None
    ) -> None:
        loader = WeightLoader(self, on_module_loaded)
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # GPT2Model checkpoints have no prefix
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # causal-mask buffers of old checkpoints; the head is tied
            if name.endswith(_CONV1D_SUFFIXES):
                tensor = tensor.t()
            if name == "transformer.wte.weight":
                tensor = self.vocab.of(tensor)
            elif name.startswith("transformer.h."):
                _, _, layer, suffix = name.split(".", 3)
                tensor = self.transformer.h[int(layer)].shard(suffix, tensor)
            loader.load(name, tensor)
        self.finish_load(loader, self.transformer.wte, tied=True)

    @classmethod
    def config_from_hf(cls, source: HFConfigSource) -> ModelConfig:
        raw = source.raw
        hidden = raw["n_embd"]
        activation = raw.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
            raise source.error(f"GPT-2 activation {activation!r} is not supported")
        return source.build(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["n_layer"],
            num_heads=raw["n_head"],
            num_kv_heads=raw["n_head"],
            head_dim=hidden // raw["n_head"],
            intermediate_size=raw.get("n_inner") or 4 * hidden,
            max_position_embeddings=raw.get("n_positions", 1024),
            norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=True,
            hidden_act=activation,
        )

    @classmethod
    def config_from_gguf(cls, source: GGUFConfigSource) -> ModelConfig:
        heads = source.common["num_heads"]
        return source.build(
            num_kv_heads=heads,
            head_dim=source.common["hidden_size"] // heads,
            norm_eps=float(source.key("attention.layer_norm_epsilon", 1e-5)),
            hidden_act="gelu_new",
        )
