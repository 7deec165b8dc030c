"""Paged attention over a flattened batch: the layer the models hold, and the metadata of a step.

The batch holds decode tokens first (one query token per request), then prefill chunks. New keys
and values are written into the pool at `slot_mapping`; each request then attends to its own
blocks, found through its block table. The pool of one layer is a tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, values).

The math is an attention backend's (layers/attention_backends.py: the compiled CPU kernel, or
SDPA), chosen once per engine. Its `build_metadata` makes one `AttentionMetadata` per step,
shared by every layer and naming the backend; a model's `PagedAttention` layer only holds its
`AttentionLayerParams` and hands them to that backend, so the model code knows no backend.

A layer may have a sliding window (its queries see only the keys of the last `window` positions,
theirs included: Mistral, Qwen2 with use_sliding_window, Gemma's local layers) and a soft-cap of
its scores (cap * tanh(score / cap) before the softmax: Gemma 2), and attention sinks (gpt-oss:
a learned logit per query head that joins each softmax's denominator and takes no value, so a
head can attend to "nothing"); all are parameters of the layer, applied by every backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionLayerParams:
    """What one layer's attention computes, for any backend."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # of q·k, before the soft-cap
    sliding_window: int | None = None  # keys at positions > query position - window; None: all
    softcap: float | None = None  # scores -> cap * tanh(score / cap); None: none
    # [num_heads] float32: each query head's sink logit (compared with scaled scores); None: none.
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


class RunsAttention(Protocol):
    """What runs every layer's attention over a step's metadata: the backend that built it
    (layers/attention_backends.py's AttentionBackend; named here by its one method, so that this
    module, below the backends, imports none of them)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, layer: AttentionLayerParams) -> torch.Tensor: ...


@dataclass
class PrefillChunk:
    """One request's run of query tokens (a prompt or a chunk of it, or a recomputation)."""

    query_start: int  # offset in the flattened batch
    query_len: int
    num_cached: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor  # [num_blocks] the request's block table, covering all its tokens
    mask: torch.Tensor | None = None  # [query_len, num_cached + query_len] when num_cached > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes in the pool
    num_decode_tokens: int = 0  # the batch's first tokens, one per decoding request
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] tokens each attends to
    decode_mask: torch.Tensor | None = None  # SDPA backend: [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    # LongRoPE models only: [num_tokens] bool, the tokens rotated with the long frequencies (a
    # choice per sequence that positions alone do not give; see layers/rotary.long_rope).
    long_rope: torch.Tensor | None = None
    # SDPA backend: decode_mask narrowed to each sliding window, made by the first layer that needs it.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # The backend that built this metadata and runs every layer's attention over it.
    backend: RunsAttention | None = None
    # A model with several KV cache groups (common/kv_cache_spec.py: Gemma's full and sliding
    # layers, each kind with a pool of its own): each group's metadata (its slots and block
    # tables) by the group's window, None for full attention; this metadata is one of them.
    # Empty: one group, this metadata serves every layer.
    groups: dict[int | None, AttentionMetadata] = field(default_factory=dict)
    # Hybrid models: each sequence's slot in its recurrent layers' state pools (layers/recurrent),
    # one per sequence in batch order (decodes, then prefill chunks); int64 on the device.
    state_slots: torch.Tensor | None = None

    def for_layer(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with this sliding window reads its pool through."""
        return self.groups[window] if self.groups else self

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        if not window or self.decode_mask is None:
            return self.decode_mask
        mask = self.window_masks.get(window)
        if mask is None:
            keys = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            inside = keys[None, :] >= (self.decode_context_lens - window)[:, None]
            mask = self.window_masks[window] = self.decode_mask & inside[:, None, None, :]
        return mask


def causal_mask_with_prefix(
    num_cached: int, query_len: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """Query i (at position num_cached + i) may see keys 0 .. num_cached + i (with a sliding
    window, only those after num_cached + i - window)."""
    keys = torch.arange(num_cached + query_len, device=device)
    queries = torch.arange(query_len, device=device) + num_cached
    mask = keys[None, :] <= queries[:, None]
    if window:
        mask &= keys[None, :] > queries[:, None] - window
    return mask


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA's math written out, for what SDPA has not: scores soft-capped before the mask and
    softmax, and a sink logit per query row joining the softmax's denominator (dropped after it).
    q [..., heads, queries, dim], k/v [..., heads, keys, dim] (heads already matched), mask
    boolean; `sinks` broadcastable to [..., heads, queries, 1]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    scores = scores.float()
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def kv_rows(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """[tokens, kv_heads, head_dim] values as the pool stores them: rounded to its dtype, or, for a
    q8_0 pool (int8), as llama.cpp's q8_0 (per 32 values: scale = max|x| / 127, codes = round(x /
    scale), then the scales in float16, 2 bytes each, after the row's codes). The C++ kernel
    (write_kv_) stores the same bytes."""
    if pool_dtype != torch.int8:
        return x.to(pool_dtype)
    blocks = x.float().unflatten(-1, (-1, 32))
    scale = blocks.abs().amax(-1) * (1.0 / 127.0)  # as the C++ kernel computes it
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inverse[..., None]).to(torch.int8).flatten(-2)
    return torch.cat([codes, scale.to(torch.float16).view(torch.int8)], dim=-1)


def kv_values(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows [..., row] back as values [..., head_dim] of `dtype` (see kv_rows)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    codes, scales = rows[..., :head_dim], rows[..., head_dim:].contiguous().view(torch.float16)
    return (codes.float().unflatten(-1, (-1, 32)) * scales.float()[..., None]).flatten(-2).to(dtype)


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, dim] pool -> the listed blocks, one whole block per row.

    Copying whole blocks (a few KiB each) is several times faster than gathering token slots.
    """
    block_size, num_kv_heads, head_dim = pool.shape[1:]
    rows = pool.view(pool.shape[0], -1).index_select(0, block_ids)
    return rows.view(-1, num_kv_heads, head_dim)  # [len(block_ids) * block_size, kv_heads, dim]


class PagedAttention(nn.Module):
    """A layer's attention of the step's queries over each request's cached keys and values, run
    by the step's backend (`AttentionMetadata.backend`)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        sliding_window: int | None = None, softcap: float | None = None, sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads cannot share {num_kv_heads} KV heads evenly")
        self.params = AttentionLayerParams(num_heads, num_kv_heads, head_dim, scale, sliding_window or None,
                                           softcap or None)
        # This rank's heads' sink logits (a weight of the checkpoint), handed to the backends with
        # the other parameters once loaded (`bind_sinks`).
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None

    def bind_sinks(self) -> None:
        """Hand the loaded sink logits to the parameters every backend reads."""
        if self.sinks is not None:
            self.params = replace(self.params, sinks=self.sinks.detach().float())

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return meta.backend.forward(q, k, v, kv_cache, meta.for_layer(self.params.sliding_window), self.params)
