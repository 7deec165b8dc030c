"""A step's flattened batch, with no padding: decode tokens first (one per request), then prefill
chunks. For every token its id, its position and its slot in each paged KV cache group's pool; for
every request its block tables (and, with a recurrent group, its state slot); the rows whose logits
are sampled (the last token of requests that are caught up, and each draft's position) and the
pooling requests' rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.common.kv_cache_spec import KVCacheGroupSpec
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.layers.attention_backends import AttentionBackend, AttentionBatch, PrefillRows
from roseinfer.worker.image_embedder import ImageEmbedder, StepImageRows
from roseinfer.worker.pooling import PoolingRows
from roseinfer.worker.request_state import CachedRequestState
from roseinfer.worker.state_pools import StatePools


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states that are sampled
    sampling: list[CachedRequestState]  # the requests those rows belong to
    pooling: list[PoolingRows]  # the pooling requests' rows of the hidden states
    image_rows: StepImageRows | None = None  # image placeholders this step computes, and their rows


class InputBatchBuilder:
    def __init__(
        self, groups: list[KVCacheGroupSpec], block_size: int, backend: AttentionBackend, device: torch.device,
        long_rope_from: int | None, state_pools: StatePools | None, image_embedder: ImageEmbedder | None = None,
    ) -> None:
        self.block_size = block_size
        self.groups = groups
        self.paged_groups = [index for index, group in enumerate(groups) if group.paged]
        self.group_windows = [groups[index].window for index in self.paged_groups]
        self.recurrent_group = next((index for index, group in enumerate(groups) if not group.paged), None)
        self.attention_backend = backend
        self.device = device
        self.long_rope_from = long_rope_from  # LongRoPE models: see build
        self.state_pools = state_pools
        self.image_embedder = image_embedder  # a vision-language model's encoder

    def build(
        self, scheduled: list[tuple[CachedRequestState, int]], spec: dict[str, list[int]]
    ) -> StepInputs:
        """The step's inputs for `scheduled` (each request with its number of new tokens, drafts
        included; `spec` its draft tokens)."""
        block_size = self.block_size
        decodes = [(state, n) for state, n in scheduled if n == 1]
        prefills = [(state, n) for state, n in scheduled if n > 1]
        ids: list[int] = []
        positions: list[np.ndarray] = []
        long_rope: list[np.ndarray] = []
        slots: list[list[np.ndarray]] = [[] for _ in self.groups]  # per KV cache group (paged ones)
        logits_indices: list[int] = []
        sampling: list[CachedRequestState] = []
        pooling: list[PoolingRows] = []
        image_parts: list = []

        for state, num_new in decodes + prefills:
            drafts = spec.get(state.req_id, ())
            start = state.num_computed_tokens
            end = start + num_new - len(drafts)
            first_row = len(ids)
            ids.extend(state.token_ids[start:end])
            ids.extend(drafts)
            if state.images and start < state.num_prompt_tokens:
                image_parts += self.image_embedder.chunk_rows(state.images, state.token_ids, start, end, first_row)
            pos = np.arange(start, start + num_new, dtype=np.int64)
            positions.append(pos)
            if self.long_rope_from is not None:  # as layers/rotary.long_rope decides
                long_rope.append(np.maximum(pos + 1, state.num_prompt_tokens) > self.long_rope_from)
            for group in self.paged_groups:
                table = np.asarray(state.block_ids[group], dtype=np.int64)
                slots[group].append(table[pos // block_size] * block_size + pos % block_size)
            if state.pooling_params is not None:  # pooled, never sampled
                pooling.append(PoolingRows(state, first_row, num_new, start, end == len(state.token_ids)))
            elif end == len(state.token_ids):  # caught up: its last position gives the next token
                # (and with drafts, each draft's position too: they are verified)
                logits_indices.extend(range(len(ids) - 1 - len(drafts), len(ids)))
                sampling.append(state)

        metas = []
        for group in self.paged_groups:
            batch = AttentionBatch(slot_mapping=np.concatenate(slots[group]))
            if decodes:
                batch.decode_block_tables, batch.decode_context_lens = self._decode_tables(
                    [state for state, _ in decodes], group)
            offset = len(decodes)
            prefill_rows = []
            for state, num_new in prefills:
                num_blocks = -(-(state.num_computed_tokens + num_new) // block_size)
                block_ids = np.asarray(state.block_ids[group][:num_blocks], dtype=np.int64)
                prefill_rows.append(PrefillRows(offset, num_new, state.num_computed_tokens, block_ids))
                offset += num_new
            batch.prefills = prefill_rows
            metas.append(self.attention_backend.build_metadata(batch))
        meta = metas[0]
        if len(metas) > 1:  # each layer reads through its group's (AttentionMetadata.for_layer)
            meta.groups = dict(zip(self.group_windows, metas, strict=True))
        if long_rope:
            long_rope_rows = self._tensor(np.concatenate(long_rope))
            for group_meta in metas:
                group_meta.long_rope = long_rope_rows
        if self.state_pools is not None:  # each sequence's state slot, in batch order
            in_order = [state for state, _ in decodes + prefills]
            state_slots = [state.block_ids[self.recurrent_group][0] for state in in_order]
            self.state_pools.zero([slot for slot, state in zip(state_slots, in_order, strict=True)
                                   if state.num_computed_tokens == 0])
            for group_meta in metas:
                group_meta.state_slots = self._tensor(np.asarray(state_slots, dtype=np.int64))

        return StepInputs(
            input_ids=self._tensor(np.asarray(ids, dtype=np.int64)),
            positions=self._tensor(np.concatenate(positions)),
            meta=meta,
            logits_indices=self._tensor(np.asarray(logits_indices, dtype=np.int64)),
            sampling=sampling,
            pooling=pooling,
            image_rows=ImageEmbedder.gather(image_parts, self.device),
        )

    def _decode_tables(self, states: list[CachedRequestState], group: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The decode rows' block tables (of KV cache group `group`), padded to the longest, and
        context lengths."""
        lengths = np.fromiter((s.num_computed_tokens + 1 for s in states), np.int64, len(states))
        max_blocks = int(-(-lengths.max() // self.block_size))
        # Padded with block 0: a real block, so the padding holds finite values the mask hides.
        padded = np.zeros((len(states), max_blocks), dtype=np.int64)
        for row, state in enumerate(states):
            table = state.block_ids[group][:max_blocks]
            padded[row, : len(table)] = table
        return padded, lengths

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)
