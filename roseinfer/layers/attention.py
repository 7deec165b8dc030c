"""Paged attention over a flattened batch.

The batch holds decode tokens first (one query token per request), then prefill chunks. New keys
and values are written into the pool at `slot_mapping`; each request then attends to its own
blocks, found through its block table. The pool of one layer is a tensor
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, values).

`AttentionMetadata` is built once per step by the model runner and shared by every layer. The
math lives behind `PagedAttention.forward`, a small interface that another backend can replace
without touching the model code. Decode steps take one of two paths: a compiled kernel that reads
the pool through the block tables (`decode_kernel`, see cpu_kernels.py), or plain PyTorch, which
gathers each request's blocks into a padded copy and runs SDPA with a length mask.

A layer may have a sliding window (its queries see only the keys of the last `window` positions,
theirs included: Mistral, Qwen2 with use_sliding_window, Gemma's local layers) and a soft-cap of
its scores (cap * tanh(score / cap) before the softmax: Gemma 2); both are parameters of the
layer's PagedAttention, applied by the C++ decode kernel and by the PyTorch paths alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers.cpu_kernels import cpu_kernels


@dataclass
class PrefillChunk:
    """One request's run of query tokens (a prompt or a chunk of it, or a recomputation)."""

    query_start: int  # offset in the flattened batch
    query_len: int
    num_cached: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor  # [num_blocks] the request's block table, covering all its tokens
    mask: torch.Tensor | None = None  # [query_len, num_cached + query_len] when num_cached > 0


# (q, k_pool, v_pool, tables, lens, scale, window, softcap) -> out; window 0: none, softcap 0: none.
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, float], torch.Tensor
]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes in the pool
    num_decode_tokens: int = 0  # the batch's first tokens, one per decoding request
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] tokens each attends to
    decode_mask: torch.Tensor | None = None  # PyTorch path: [num_decodes, 1, 1, max_blocks * block_size]
    decode_kernel: DecodeKernel | None = None  # (q, k_pool, v_pool, tables, lens, scale, window, softcap) -> out
    prefills: list[PrefillChunk] = field(default_factory=list)
    # LongRoPE models only: [num_tokens] bool, the tokens rotated with the long frequencies (a
    # choice per sequence that positions alone do not give; see layers/rotary.long_rope).
    long_rope: torch.Tensor | None = None
    # PyTorch path: decode_mask narrowed to each sliding window, made by the first layer that needs it.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

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


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """SDPA's math with the scores soft-capped before the mask and softmax (SDPA has no soft-cap);
    q [..., heads, queries, dim], k/v [..., heads, keys, dim] (heads already matched), mask boolean."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's new keys and values at their slots (rounded to the pool's dtype, which
    `--kv-cache-dtype` may make narrower than the model's)."""
    kernels = cpu_kernels() if kv_cache.device.type == "cpu" else None
    if kernels is not None and _heads_contiguous(k) and _heads_contiguous(v):
        kernels.write_kv_(kv_cache, slot_mapping, k, v)
        return
    slots = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    slots[0].index_copy_(0, slot_mapping, kv_rows(k, kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, kv_rows(v, kv_cache.dtype))


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


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads in one run (tokens may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, dim] pool -> the listed blocks, one whole block per row.

    Copying whole blocks (a few KiB each) is several times faster than gathering token slots.
    """
    block_size, num_kv_heads, head_dim = pool.shape[1:]
    rows = pool.view(pool.shape[0], -1).index_select(0, block_ids)
    return rows.view(-1, num_kv_heads, head_dim)  # [len(block_ids) * block_size, kv_heads, dim]


class PagedAttention(nn.Module):
    """Attention of the step's queries over each request's cached keys and values (plain PyTorch)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        sliding_window: int | None = None, softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window or None
        self.softcap = softcap or None
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads cannot share {num_kv_heads} KV heads evenly")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(kv_cache, meta.slot_mapping, k, v)
        num_decodes = meta.num_decode_tokens
        if not meta.prefills:  # decodes only: no need to assemble the output
            return self._decode(q, kv_cache, meta)
        out = torch.empty_like(q)
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta)
        for chunk in meta.prefills:
            end = chunk.query_start + chunk.query_len
            out[chunk.query_start : end] = self._prefill(
                q[chunk.query_start : end], k[chunk.query_start : end], v[chunk.query_start : end],
                kv_cache, chunk,
            )
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_kernel is not None:
            return meta.decode_kernel(
                q, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_context_lens, self.scale,
                self.sliding_window or 0, self.softcap or 0.0,
            )
        batch = q.shape[0]
        block_ids = meta.decode_block_tables.view(-1)
        keys = kv_values(gather_blocks(kv_cache[0], block_ids), self.head_dim, q.dtype).view(
            batch, -1, self.num_kv_heads, self.head_dim)
        values = kv_values(gather_blocks(kv_cache[1], block_ids), self.head_dim, q.dtype).view(
            batch, -1, self.num_kv_heads, self.head_dim)
        # One query token per request: the heads sharing a KV head become that head's query rows,
        # so grouped-query attention needs no copies of K and V.
        grouped = q.view(batch, self.num_kv_heads, self.group, self.head_dim)
        mask = meta.decode_mask_for(self.sliding_window)
        if self.softcap:
            out = softcapped_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2), mask, self.scale,
                                       self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=self.scale,
            )
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        window = self.sliding_window
        if window and chunk.num_cached + chunk.query_len <= window:
            window = None  # every query sees all it would see without the window
        if chunk.num_cached == 0:
            # The whole context is in this chunk: attend to the fresh keys, causally.
            keys, values, mask, causal = k, v, None, True
        else:
            context = chunk.num_cached + chunk.query_len
            keys = kv_values(gather_blocks(kv_cache[0], chunk.block_ids)[:context], self.head_dim, q.dtype)
            values = kv_values(gather_blocks(kv_cache[1], chunk.block_ids)[:context], self.head_dim, q.dtype)
            mask, causal = chunk.mask, False
        if window or (self.softcap and causal):
            mask, causal = causal_mask_with_prefix(chunk.num_cached, chunk.query_len, q.device, window), False
        if self.softcap:
            group = self.group
            out = softcapped_attention(
                q.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(group, 0),
                values.transpose(0, 1).repeat_interleave(group, 0), mask, self.scale, self.softcap,
            )
            return out.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.group > 1,
        )
        return out.transpose(0, 1)
