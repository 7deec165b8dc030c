"""Logits at every position of a token chunk, from a model loaded exactly as the engine serves it.

The model comes from `load_model` (the engine's loader: same weights, dtype and linear kernels
chosen by `--quantization`) and runs its usual forward over a flattened batch: the chunk is one
prefill from an empty cache, through the paged attention layer and a private KV pool, as a prompt
of that length is computed when served. Only the rows asked for go through the LM head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.layers.attention_backends import (
    AttentionBatch,
    PrefillRows,
    select_attention_backend,
)
from roseinfer.models.loader import load_model
from roseinfer.tokenizer import Tokenizer

_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Mode:
    """A dtype, a quantization method and optionally a KV cache dtype, written
    `dtype+quantization[+kv_cache_dtype]` on the command line (e.g. float32+int4+bfloat16)."""

    dtype: str
    quantization: str
    kv_cache_dtype: str = "auto"

    @classmethod
    def parse(cls, text: str) -> Mode:
        parts = text.split("+")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"expected DTYPE+QUANTIZATION[+KV_CACHE_DTYPE] (e.g. float32+int4), got {text!r}")
        return cls(*parts)

    def __str__(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f"+{self.kv_cache_dtype}"
        return f"{self.dtype}+{self.quantization}{kv}"


class ChunkLogits:
    """One loaded model, ready to compute the logits of chunks of up to `max_tokens`."""

    def __init__(
        self, model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype, max_tokens: int,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.max_tokens = max_tokens
        num_blocks = -(-max_tokens // _BLOCK_SIZE)
        pool_dtype = kv_cache_dtype or dtype
        shape = (2, num_blocks, _BLOCK_SIZE, config.num_kv_heads, config.kv_row_elements(pool_dtype))
        self.kv_caches = [
            torch.zeros(shape, dtype=pool_dtype, device=device) for _ in range(config.num_layers)
        ]
        self.attention = select_attention_backend("auto", device, _BLOCK_SIZE)  # as the engine's default

    @classmethod
    def load(
        cls, model: str | None, tokenizer: str | None, device: str, mode: Mode, max_tokens: int
    ) -> tuple[ChunkLogits, Tokenizer]:
        """Load `model` in `mode` as the engine would (arguments as the engine's); also its tokenizer."""
        config = EngineConfig.from_kwargs(
            model=model, tokenizer=tokenizer, device=device, dtype=mode.dtype, quantization=mode.quantization,
            kv_cache_dtype=mode.kv_cache_dtype,
        )
        loaded = load_model(config.model, config.tokenizer, config.torch_device, config.torch_dtype, config.quantization)
        chunk_logits = cls(loaded.model, loaded.config, config.torch_device, config.torch_dtype, max_tokens,
                           config.kv_cache_torch_dtype)
        return chunk_logits, loaded.tokenizer

    @torch.inference_mode()
    def __call__(self, token_ids: Sequence[int], rows: slice, tokens_per_step: int | None = None) -> torch.Tensor:
        """Logits [len(rows), vocab] (the model's dtype) of positions `rows` of the chunk. With
        `tokens_per_step`, the chunk is fed that many tokens at a time (a chunked prefill over the
        cache so far), so that no layer sees more rows than a decode step of that batch size."""
        count = len(token_ids)
        if not 0 < count <= self.max_tokens:
            raise ValueError(f"a chunk holds 1 to {self.max_tokens} tokens, got {count}")
        wanted = range(count)[rows]
        step = tokens_per_step or count
        logits = []
        for start in range(0, count, step):
            end = min(start + step, count)
            hidden = self._forward(token_ids[start:end], start)
            take = [i - start for i in wanted if start <= i < end]
            if take:
                logits.append(self.model.compute_logits(hidden[take]))
        return torch.cat(logits)

    def _forward(self, token_ids: Sequence[int], num_cached: int) -> torch.Tensor:
        """Hidden states of `token_ids` at positions num_cached.., after the cache's first num_cached."""
        input_ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(num_cached, num_cached + len(token_ids), device=self.device)
        block_ids = np.arange(-(-(num_cached + len(token_ids)) // _BLOCK_SIZE))
        meta = self.attention.build_metadata(AttentionBatch(
            slot_mapping=np.arange(num_cached, num_cached + len(token_ids)),
            prefills=[PrefillRows(query_start=0, query_len=len(token_ids), num_cached=num_cached, block_ids=block_ids)],
        ))
        return self.model(input_ids, positions, self.kv_caches, meta)
