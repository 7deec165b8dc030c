"""What the decoder-only families share: the causal LM's frame (this rank's head over the vocabulary,
the logits, the end of a weight load), the pre-norm decoder layer (a norm, a token mixer, a norm,
an MLP) whose mixer is attention or, in a hybrid model's recurrent layers, a recurrence, and the
Llama-layout model (`model.embed_tokens`, `model.layers`, `model.norm`) with its forward loop.

A family states what differs through small hooks (`make_attention`, `make_mlp`, `mix`,
`feed_forward`, `embed_input_ids`, `layer_rotations`, `build_rotary`) instead of writing the loop
again; the parameter names stay its checkpoint's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from roseinfer.config import ModelConfig
from roseinfer.distributed.parallel_state import get_tp_group
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.norm import RMSNorm
from roseinfer.layers.parallel import VocabParallelEmbedding, gather_logits
from roseinfer.layers.recurrent import recurrence_class
from roseinfer.layers.rotary import RotaryEmbedding, rope_frequencies
from roseinfer.models.weights import WeightLoader


class CausalLM(nn.Module):
    """A model's config and tensor-parallel group, its LM head over this rank's vocabulary rows
    (`add_lm_head`, after the backbone), the logits gathered on rank 0, and the end of a load."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()

    def add_lm_head(self, embedding: VocabParallelEmbedding) -> None:
        self.vocab = embedding.shard  # this rank's vocabulary rows
        self.lm_head = nn.Linear(self.config.hidden_size, self.vocab.rows, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0 (None on the other ranks)."""
        return gather_logits(self.lm_head(hidden), self.config.vocab_size, self.tp)

    def skips_tensor(self, name: str) -> bool:
        """A checkpoint tensor the model does not hold: rotary frequency buffers, a tied head."""
        return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings)

    def finish_load(self, loader: WeightLoader, embedding: nn.Module, tied: bool | None = None) -> None:
        """Point a tied head at the embedding (`tied`: default the config's), then check that every
        parameter came."""
        if self.config.tie_word_embeddings if tied is None else tied:
            self.lm_head.weight = embedding.weight
            loader.mark_loaded("lm_head.weight")
        loader.check_complete()


class DecoderLayer(nn.Module):
    """input_layernorm, a token mixer (`self_attn`; in a hybrid model's recurrent layers the
    recurrence, under the attribute `recurrent_mixer` names), post_attention_layernorm, mlp.
    Takes and returns (this layer's output before its residual add, the residual stream): the add
    is left to the next norm, which does both in one pass."""

    # The attribute a recurrent layer's mixer is held under (its checkpoint's name); None: every
    # layer attends.
    recurrent_mixer: ClassVar[str | None] = None

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        recurrent = config.recurrent if self.recurrent_mixer is not None else None
        assert recurrent is not None or self.recurrent_mixer is None
        self.is_recurrent = recurrent is not None and layer in recurrent.layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        if self.is_recurrent:
            setattr(self, self.recurrent_mixer, recurrence_class(recurrent.kind)(recurrent.params))
        else:
            self.self_attn = self.make_attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = self.make_mlp(config, layer)

    def make_attention(self, config: ModelConfig, layer: int) -> nn.Module:
        raise NotImplementedError

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module | None:
        raise NotImplementedError

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm before the MLP (that adds the residual)."""
        return self.post_attention_layernorm

    def mix(self, hidden: torch.Tensor, rotations: torch.Tensor, cache: Any, meta: AttentionMetadata) -> torch.Tensor:
        """The token mixer's output; `cache`: the layer's KV pool, or its recurrent state pools."""
        if self.is_recurrent:
            return getattr(self, self.recurrent_mixer)(hidden, cache, meta)
        return self.self_attn(hidden, rotations, cache, meta)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mlp(hidden)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rotations: torch.Tensor, cache: Any,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden, residual = self.mlp_norm.add_and_norm(self.mix(hidden, rotations, cache, meta), residual)
        return self.feed_forward(hidden), residual


class DecoderBackbone(nn.Module):
    """embed_tokens, one `layer_class` per layer, the final norm (Hugging Face's `model.`)."""

    layer_class: ClassVar[type[nn.Module]]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)


def default_rotary(config: ModelConfig) -> RotaryEmbedding:
    """The config's rotary embedding over its first `rotary_dim` dimensions of each head (all by
    default), with its scaling."""
    return RotaryEmbedding.from_frequencies(
        rope_frequencies(config.rotary_dim or config.head_dim, config.rope_theta, config.rope_scaling,
                         config.max_position_embeddings),
        config.head_dim,
    )


class DecoderForCausalLM(CausalLM):
    """A decoder of `DecoderLayer`-shaped layers under `model` (`backbone_class`), rotated by one
    table (`build_rotary`; a family with several picks per layer in `layer_rotations`)."""

    backbone_class: ClassVar[type[nn.Module]]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = self.backbone_class(config)
        self.add_lm_head(self.model.embed_tokens)
        self.rotary = self.build_rotary(config)

    def build_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        return default_rotary(config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[Any],  # per layer: its KV pool, or its recurrent state pools (at meta.state_slots)
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # instead of looking input_ids up (image rows spliced in)
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flattened batch (no padding)."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        rotations = self.layer_rotations(positions, meta)
        for layer, layer_rotations, cache in zip(self.model.layers, rotations, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, layer_rotations, cache, meta)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def layer_rotations(self, positions: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor]:
        """Each layer's rotations of the step's positions (one table: the same for every layer)."""
        return [self.rotary.rotations(positions, meta.long_rope)] * len(self.model.layers)
