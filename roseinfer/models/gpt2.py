"""GPT-2 in plain PyTorch: learned positions, LayerNorm, fused q/k/v with biases, GELU MLP.

Parameters use Hugging Face's GPT2LMHeadModel names; its Conv1D matrices are stored transposed
(`[in, out]`), so `load_weights` transposes them into `nn.Linear` layout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.layers.attention import AttentionMetadata, PagedAttention
from roseinfer.models.weights import WeightLoader

_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.ln_1 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn.c_proj = nn.Linear(hidden, hidden)
        self.attn.paged = PagedAttention(
            config.num_heads, config.num_heads, config.head_dim, config.head_dim**-0.5
        )
        self.ln_2 = nn.LayerNorm(hidden, eps=config.norm_eps)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(hidden, config.intermediate_size)
        self.mlp.c_proj = nn.Linear(config.intermediate_size, hidden)
        self.gelu_approximation = _GELU_APPROXIMATION[config.hidden_act]

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        shape = (num_tokens, self.num_heads, self.head_dim)
        q, k, v = self.attn.c_attn(self.ln_1(hidden)).split(self.hidden_size, dim=-1)
        out = self.attn.paged(q.view(shape), k.view(shape), v.view(shape), kv_cache, meta)
        hidden = hidden + self.attn.c_proj(out.view(num_tokens, self.hidden_size))
        mlp = F.gelu(self.mlp.c_fc(self.ln_2(hidden)), approximate=self.gelu_approximation)
        return hidden + self.mlp.c_proj(mlp)


class GPT2Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # GPT2Model checkpoints have no prefix
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # causal-mask buffers of old checkpoints; the head is tied
            if name.endswith(_CONV1D_SUFFIXES):
                tensor = tensor.t()
            loader.load(name, tensor)
        self.lm_head.weight = self.transformer.wte.weight
        loader.mark_loaded("lm_head.weight")
        loader.check_complete()
