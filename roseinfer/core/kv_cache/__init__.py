"""The KV cache's bookkeeping: one coordinator (coordinator.py) over a single-kind manager per KV
cache group (common/kv_cache_spec.py), each over a pool of its own (block_pool.py)."""

from roseinfer.core.kv_cache.block_pool import (
           RELEASED,
           BlockCopy,
           BlockPool,
           PrefixCacheStats,
           chain_root,
)
from roseinfer.core.kv_cache.coordinator import KVCacheCoordinator
from roseinfer.core.kv_cache.full_attention import KVCacheManager
from roseinfer.core.kv_cache.recurrent_state import RecurrentStateManager
from roseinfer.core.kv_cache.sliding_window import SlidingWindowManager

__all__ = ["RELEASED", "BlockCopy", "BlockPool", "KVCacheCoordinator", "KVCacheManager", "PrefixCacheStats",
           "RecurrentStateManager", "SlidingWindowManager", "chain_root"]
