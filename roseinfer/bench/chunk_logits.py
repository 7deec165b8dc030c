"""Logits at every position of a token chunk, from a model loaded exactly as the engine serves it.

The model comes from `load_model` (the engine's loader: same weights, dtype and linear kernels
chosen by `--quantization`) and runs its usual forward over a flattened batch: the chunk is one
prefill from an empty cache, through the paged attention layer and a private KV pool, as a prompt
of that length is computed when served. Only the rows asked for go through the LM head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.layers.attention import AttentionMetadata, PrefillChunk
from roseinfer.models.loader import load_model
from roseinfer.tokenizer import Tokenizer

_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Mode:
    """A dtype and quantization method, written `dtype+quantization` on the command line."""

    dtype: str
    quantization: str

    @classmethod
    def parse(cls, text: str) -> Mode:
        dtype, plus, quantization = text.partition("+")
        if not plus or not dtype or not quantization:
            raise ValueError(f"expected DTYPE+QUANTIZATION (e.g. float32+int4), got {text!r}")
        return cls(dtype, quantization)

    def __str__(self) -> str:
        return f"{self.dtype}+{self.quantization}"


class ChunkLogits:
    """One loaded model, ready to compute the logits of chunks of up to `max_tokens`."""

    def __init__(
        self, model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype, max_tokens: int
    ) -> None:
        self.model = model
        self.device = device
        self.max_tokens = max_tokens
        num_blocks = -(-max_tokens // _BLOCK_SIZE)
        shape = (2, num_blocks, _BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @classmethod
    def load(
        cls, model: str | None, tokenizer: str | None, device: str, mode: Mode, max_tokens: int
    ) -> tuple[ChunkLogits, Tokenizer]:
        """Load `model` in `mode` as the engine would (arguments as the engine's); also its tokenizer."""
        config = EngineConfig.from_kwargs(
            model=model, tokenizer=tokenizer, device=device, dtype=mode.dtype, quantization=mode.quantization
        )
        loaded = load_model(config.model, config.tokenizer, config.torch_device, config.torch_dtype, config.quantization)
        return cls(loaded.model, loaded.config, config.torch_device, config.torch_dtype, max_tokens), loaded.tokenizer

    @torch.inference_mode()
    def __call__(self, token_ids: Sequence[int], rows: slice) -> torch.Tensor:
        """Logits [len(rows), vocab] (the model's dtype) of positions `rows` of the chunk."""
        count = len(token_ids)
        if not 0 < count <= self.max_tokens:
            raise ValueError(f"a chunk holds 1 to {self.max_tokens} tokens, got {count}")
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(count, device=self.device)
        block_ids = torch.arange(-(-count // _BLOCK_SIZE), device=self.device)
        meta = AttentionMetadata(slot_mapping=positions)
        meta.prefills.append(PrefillChunk(query_start=0, query_len=count, num_cached=0, block_ids=block_ids))
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[rows])
