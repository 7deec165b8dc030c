"""Attention backends: one is chosen per engine (`select_attention_backend`, from
`--attention-backend`, the device and whether the C++ kernels built) and runs every layer's
attention, so neither the model code nor the model runner tests for kernels.

A backend has two jobs, as in vLLM v1 (metadata builder + attention implementation):
- `build_metadata(batch)`: the step's `AttentionMetadata` from the runner's host-side layout of the
  scheduled batch (slot of each new token, decode rows' block tables and context lengths, prefill
  chunks), once per step and shared by every layer;
- `forward(q, k, v, kv_cache, meta, layer)`: store the new keys and values, then attend, with the
  layer's `AttentionLayerParams` (scale, sliding window, soft-cap, sinks).

Backends: "cpp" (the compiled CPU decode kernel, layers/csrc/paged_attention_cpu.cpp, and the C++
KV write; prefill chunks through SDPA) and "torch" (plain PyTorch: gathered blocks + SDPA with a
length mask, on any device). What SDPA lacks (soft-cap, sinks) runs as the same math written out
(`explicit_attention`); the C++ kernel has no sinks, so "cpp" hands layers with sinks (gpt-oss) to
the PyTorch decode. A CUDA backend is one more class and registry entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from roseinfer.errors import InvalidRequestError
from roseinfer.layers.attention import (
    AttentionLayerParams,
    AttentionMetadata,
    PrefillChunk,
    causal_mask_with_prefix,
    explicit_attention,
    gather_blocks,
    kv_rows,
    kv_values,
)
from roseinfer.layers.cpu_kernels import cpu_kernels


@dataclass
class PrefillRows:
    """One prefill chunk of the batch (host side)."""

    query_start: int  # offset in the flattened batch
    query_len: int
    num_cached: int  # the request's tokens already in the cache
    block_ids: np.ndarray  # the request's blocks covering num_cached + query_len tokens


@dataclass
class AttentionBatch:
    """The attention layout of one scheduled step, as the model runner lays it out (numpy, host)."""

    slot_mapping: np.ndarray  # [num_tokens]
    decode_block_tables: np.ndarray | None = None  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: np.ndarray | None = None  # [num_decodes]
    prefills: tuple[PrefillRows, ...] | list[PrefillRows] = ()


class AttentionBackend(ABC):
    """Builds a step's metadata and runs each layer's attention over the paged pool."""

    name: ClassVar[str]
    # Whether the fused C++ decode step (models/fused_decode.py), which calls the compiled
    # attention kernel itself, may stand in for the model's decode steps under this backend.
    runs_fused_decode: ClassVar[bool] = False

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size

    @classmethod
    def create(cls, device: torch.device, block_size: int) -> AttentionBackend:
        """The backend for `device`, or InvalidRequestError naming why it cannot run there."""
        return cls(device, block_size)

    # -- metadata ---------------------------------------------------------------------------
    def build_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self._tensor(batch.slot_mapping), backend=self)
        if batch.decode_context_lens is not None and len(batch.decode_context_lens):
            meta.num_decode_tokens = len(batch.decode_context_lens)
            meta.decode_block_tables = self._tensor(batch.decode_block_tables)
            meta.decode_context_lens = self._tensor(batch.decode_context_lens)
            self._decode_metadata(meta, batch)
        for rows in batch.prefills:
            mask = causal_mask_with_prefix(rows.num_cached, rows.query_len, self.device) if rows.num_cached else None
            meta.prefills.append(PrefillChunk(rows.query_start, rows.query_len, rows.num_cached,
                                              self._tensor(rows.block_ids), mask))
        return meta

    @abstractmethod
    def _decode_metadata(self, meta: AttentionMetadata, batch: AttentionBatch) -> None:
        """What this backend adds to the decode rows' metadata (block tables and lengths are there)."""

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    # -- attention --------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer: AttentionLayerParams,
    ) -> torch.Tensor:
        """Store the new keys and values, then attend: the decode rows in one call, each prefill
        chunk in its own."""
        self.write_kv(kv_cache, meta.slot_mapping, k, v)
        num_decodes = meta.num_decode_tokens
        if not meta.prefills:  # decodes only: no need to assemble the output
            return self.decode(q, kv_cache, meta, layer)
        out = torch.empty_like(q)
        if num_decodes:
            out[:num_decodes] = self.decode(q[:num_decodes], kv_cache, meta, layer)
        for chunk in meta.prefills:
            end = chunk.query_start + chunk.query_len
            out[chunk.query_start : end] = self.prefill(
                q[chunk.query_start : end], k[chunk.query_start : end], v[chunk.query_start : end],
                kv_cache, chunk, layer,
            )
        return out

    @abstractmethod
    def write_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys and values at their slots (rounded to the pool's dtype, which
        `--kv-cache-dtype` may make narrower than the model's)."""

    @abstractmethod
    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, layer: AttentionLayerParams
    ) -> torch.Tensor:
        """The decode rows' attention (one query token per request)."""

    @abstractmethod
    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, chunk: PrefillChunk,
        layer: AttentionLayerParams,
    ) -> torch.Tensor:
        """One prefill chunk's attention over its request's cached and fresh keys."""


class TorchAttentionBackend(AttentionBackend):
    """"torch": plain PyTorch on any device (gathered blocks + SDPA)."""

    name: ClassVar[str] = "torch"

    def _decode_metadata(self, meta: AttentionMetadata, batch: AttentionBatch) -> None:
        """SDPA over the padded blocks: a mask of each row's real keys."""
        meta.decode_mask = self._length_mask(meta)

    def _length_mask(self, meta: AttentionMetadata) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size]: which padded key slots each row reads."""
        keys = torch.arange(meta.decode_block_tables.shape[1] * self.block_size, device=self.device)
        return (keys[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]

    def write_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        slots[0].index_copy_(0, slot_mapping, kv_rows(k, kv_cache.dtype))
        slots[1].index_copy_(0, slot_mapping, kv_rows(v, kv_cache.dtype))

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, layer: AttentionLayerParams
    ) -> torch.Tensor:
        """The decode rows: each request's blocks gathered into a padded copy, SDPA with a length mask."""
        batch, head_dim, kv_heads = q.shape[0], layer.head_dim, layer.num_kv_heads
        block_ids = meta.decode_block_tables.view(-1)
        keys = kv_values(gather_blocks(kv_cache[0], block_ids), head_dim, q.dtype).view(batch, -1, kv_heads, head_dim)
        values = kv_values(gather_blocks(kv_cache[1], block_ids), head_dim, q.dtype).view(batch, -1, kv_heads, head_dim)
        # One query token per request: the heads sharing a KV head become that head's query rows,
        # so grouped-query attention needs no copies of K and V.
        grouped = q.view(batch, kv_heads, layer.group, head_dim)
        mask = meta.decode_mask_for(layer.sliding_window)
        if layer.softcap or layer.sinks is not None:
            sinks = layer.sinks.view(kv_heads, layer.group, 1) if layer.sinks is not None else None
            out = explicit_attention(grouped, keys.transpose(1, 2), values.transpose(1, 2), mask, layer.scale,
                                     layer.softcap, sinks)
        else:
            out = F.scaled_dot_product_attention(
                grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=layer.scale,
            )
        return out.reshape(batch, layer.num_heads, head_dim)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        chunk: PrefillChunk,
        layer: AttentionLayerParams,
    ) -> torch.Tensor:
        """One prefill chunk: SDPA over the fresh keys (causal), or over the cached ones and the
        fresh (a mask), with the window in the mask and the soft-cap in plain math."""
        window = layer.sliding_window
        if window and chunk.num_cached + chunk.query_len <= window:
            window = None  # every query sees all it would see without the window
        if chunk.num_cached == 0:
            # The whole context is in this chunk: attend to the fresh keys, causally.
            keys, values, mask, causal = k, v, None, True
        else:
            context = chunk.num_cached + chunk.query_len
            keys = kv_values(gather_blocks(kv_cache[0], chunk.block_ids)[:context], layer.head_dim, q.dtype)
            values = kv_values(gather_blocks(kv_cache[1], chunk.block_ids)[:context], layer.head_dim, q.dtype)
            mask, causal = chunk.mask, False
        explicit = bool(layer.softcap) or layer.sinks is not None
        if window or (explicit and causal):
            mask, causal = causal_mask_with_prefix(chunk.num_cached, chunk.query_len, q.device, window), False
        if explicit:
            group = layer.group
            sinks = layer.sinks.view(layer.num_heads, 1, 1) if layer.sinks is not None else None
            out = explicit_attention(
                q.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(group, 0),
                values.transpose(0, 1).repeat_interleave(group, 0), mask, layer.scale, layer.softcap, sinks,
            )
            return out.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=layer.scale, enable_gqa=layer.group > 1,
        )
        return out.transpose(0, 1)



class CpuKernelAttentionBackend(TorchAttentionBackend):
    """"cpp": decode rows through the compiled kernel, which reads the pool through the block
    tables (no gathered copy, no mask); new keys and values stored by the C++ write. Prefill
    chunks as the PyTorch backend."""

    name: ClassVar[str] = "cpp"
    runs_fused_decode: ClassVar[bool] = True

    def __init__(self, device: torch.device, block_size: int, kernels: Any) -> None:
        super().__init__(device, block_size)
        self.kernels = kernels
        self._decode_kernel = kernels.paged_decode_attention

    @classmethod
    def create(cls, device: torch.device, block_size: int) -> AttentionBackend:
        if device.type != "cpu":
            raise InvalidRequestError(f"attention_backend 'cpp' runs on the CPU only, not {device}", "attention_backend")
        kernels = cpu_kernels()
        if kernels is None:
            raise InvalidRequestError("attention_backend 'cpp': the C++ kernel could not be built", "attention_backend")
        return cls(device, block_size, kernels)

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return device.type == "cpu" and cpu_kernels() is not None

    def _decode_metadata(self, meta: AttentionMetadata, batch: AttentionBatch) -> None:
        pass  # the kernel takes the block tables and lengths as they are

    def write_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if _heads_contiguous(k) and _heads_contiguous(v):
            self.kernels.write_kv_(kv_cache, slot_mapping, k, v)
        else:
            super().write_kv(kv_cache, slot_mapping, k, v)

    def decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, layer: AttentionLayerParams
    ) -> torch.Tensor:
        if layer.sinks is not None:  # the kernel has no sinks: PyTorch's decode, over a length mask
            if meta.decode_mask is None:
                meta.decode_mask = self._length_mask(meta)
            return super().decode(q, kv_cache, meta, layer)
        return self._decode_kernel(
            q, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_context_lens, layer.scale,
            layer.sliding_window or 0, layer.softcap or 0.0,
        )


def _heads_contiguous(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads in one run (tokens may be strided)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


# --attention-backend name -> backend ("auto" is resolved by select_attention_backend).
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    CpuKernelAttentionBackend.name: CpuKernelAttentionBackend,
    TorchAttentionBackend.name: TorchAttentionBackend,
}


def select_attention_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """The engine's one backend: `name`, or for "auto" the C++ kernel on a CPU where it builds and
    PyTorch elsewhere."""
    if name == "auto":
        name = "cpp" if CpuKernelAttentionBackend.available(device) else "torch"
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise InvalidRequestError(
            f"attention_backend must be one of auto, {', '.join(ATTENTION_BACKENDS)}; got {name!r}", "attention_backend"
        )
    return backend.create(device, block_size)
