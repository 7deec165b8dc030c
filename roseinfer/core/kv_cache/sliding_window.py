"""The sliding-window manager: a KV cache group of layers that never read a key more than `window`
positions back, beside full-attention layers (Gemma 2 / 3: local and global layers). Its table
releases the blocks wholly before the window as the sequence grows (full_attention.py's
`attention_span`), so a sequence holds at most `sliding_blocks_per_sequence` blocks of its pool
(common/kv_cache_spec.py).

A prefix-cache hit of L tokens needs only the blocks this group's window reads after L; the
coordinator asks for them with `window_hit` (vLLM's sliding-window lookup): an evicted block before
the window does not shorten the hit, one inside it does.
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer.core.kv_cache.block_pool import RELEASED, BlockKey
from roseinfer.core.kv_cache.full_attention import KVCacheManager


class SlidingWindowManager(KVCacheManager):
    def __init__(
        self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True,
        max_num_seqs: int = 1, group: int = 0,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, max_num_seqs, window, group)

    @property
    def window(self) -> int:
        return self.attention_span

    def cached_blocks(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Each key's cached block in this group's pool, or None where it has none."""
        return [self.pool.cached.get(key) for key in keys]

    def window_hit(self, cached: Sequence[int | None], hit: int) -> list[int] | None:
        """The table a prefix hit of `hit` blocks starts with here (RELEASED before the window of
        the next query), from `cached` (cached_blocks of the prefix's keys); None where a block
        the window reads is not cached."""
        first = self._num_released(hit * self.block_size)
        window = cached[first:hit]
        if any(block is None for block in window):
            return None
        return [RELEASED] * first + list(window)
