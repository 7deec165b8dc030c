"""The seed's import path of the full-attention block manager (tests/test_kv_cache_manager.py); the
KV cache's bookkeeping lives in core/kv_cache/."""

from roseinfer.core.kv_cache.full_attention import KVCacheManager

__all__ = ["KVCacheManager"]
