"""The paged KV cache's block pool: fixed-size blocks with reference counts, a free queue, and the
prefix cache's key -> block map. It knows nothing about tensors; the model runner owns the memory.

Prefix caching keys. Once every token of a block has its K/V computed, the block is registered under
a key chained over the token ids of the whole prefix up to it: SHA-256 of (the key of the block
before, this block's token ids as little-endian int64), the first block chained to the root of its
request's `cache_salt` (32 zero bytes without one, else SHA-256 of b"cache_salt\0" + the salt in
UTF-8). A cryptographic hash because the cache is shared between callers: with a 64-bit `hash()`
a crafted prompt could collide with another tenant's prefix and read its K/V (vLLM's
CVE-2025-25183). The salt is vLLM's: requests share cached blocks only when their salts are equal,
so a tenant that sends its own secret salt can neither reuse nor time other tenants' prefixes. The
K/V of a token depend only on the model and the tokens before it, so the token ids are all a key
needs here (no adapters or images change K/V in this engine).

The free queue. A finished request's registered blocks stay in the cache while free: the free queue
is ordered so that blocks nobody can reuse are handed out first, then registered ones, least
recently released first (LRU). A block leaves the cache exactly when it is handed out again.

Placement. Decode attention reads each request's blocks in order, and memory streams far faster
through adjacent blocks than through scattered ones (the hardware prefetcher follows a stream, not
a block table). The pool is cut into one lane per sequence the scheduler may run at once: a
request starts at the first free lane and its next block is the one after its last while that
one is free and uncached, so requests decoding side by side each keep a run of adjacent blocks.
Lanes are reused lowest first, so memory that was never written stays untouched (the pool is
committed lazily, see the model runner). Which uncached block is handed out never changes what
the prefix cache keeps.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BlockKey = bytes  # the SHA-256 digest of a block's whole prefix (see Prefix caching above)
_TOKEN_BYTES = np.dtype("<i8")  # how a block's token ids enter its hash
_UNSALTED_ROOT = bytes(32)
RELEASED = -1  # a block-table place whose block fell out of every layer's sliding window


def chain_root(cache_salt: str | None, variant: str | None = None) -> BlockKey:
    """The key a request's first block is chained to: its salt's, so salts never share blocks. A
    `variant` (keys the model computes differently for the same tokens: LongRoPE's long
    frequencies, see Request.kv_variant) has a root of its own that no salt can reach."""
    if variant is not None:
        return hashlib.sha256(b"variant\0" + variant.encode() + b"\0" + chain_root(cache_salt)).digest()
    if cache_salt is None:
        return _UNSALTED_ROOT
    return hashlib.sha256(b"cache_salt\0" + cache_salt.encode()).digest()


def chain_keys(
    token_ids: Sequence[int], keys: list[BlockKey], num_full_blocks: int, block_size: int,
    cache_salt: str | None, variant: str | None = None,
) -> list[BlockKey]:
    """Extend `keys` (the first blocks' keys) to cover `num_full_blocks` blocks: one digest a
    block, over the token bytes converted once for all of them."""
    first = len(keys)
    if first >= num_full_blocks:
        return keys
    data = np.asarray(token_ids[first * block_size : num_full_blocks * block_size], dtype=_TOKEN_BYTES).tobytes()
    step = block_size * _TOKEN_BYTES.itemsize
    parent = keys[-1] if keys else chain_root(cache_salt, variant)
    for offset in range(0, len(data), step):
        parent = hashlib.sha256(parent + data[offset : offset + step]).digest()
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the runner copies block `src` into `dst` before the step's forward."""

    src: int
    dst: int
    group: int = 0  # the KV cache group whose pool holds both (see coordinator.py)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class BlockPool:
    """Block ids with reference counts, a free queue and the prefix cache's key -> block map."""

    def __init__(self, num_blocks: int, lanes: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.lane_size = max(1, num_blocks // max(1, lanes))
        self.ref_counts = [0] * num_blocks
        self.keys: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}
        # Every free block, cached ones in release order. Free uncached blocks (`_open`) are handed
        # out first, by placement; a cached block is evicted only when none is left, oldest first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._open = np.ones(num_blocks, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """`count` blocks for a table whose last block is `after` (None: a table of its own
        blocks starts here), placed after it where they are free (see Placement above)."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block = self._next_block(after)
            del self._free[block]
            self._open[block] = False
            after = block
            key = self.keys[block]
            if key is not None:  # evicted: its key must not lead anyone to its new contents
                del self.cached[key]
                self.keys[block] = None
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _next_block(self, after: int | None) -> int:
        if after is not None and 0 <= after and after + 1 < self.num_blocks and self._open[after + 1]:
            return after + 1
        lane_starts = self._open[:: self.lane_size]
        if lane_starts.any():
            return int(np.argmax(lane_starts)) * self.lane_size
        if self._open.any():
            return int(np.argmax(self._open))
        return next(iter(self._free))  # only cached blocks are free: the oldest release

    def incref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]  # a cached block taken back into use
            self.ref_counts[block] += 1

    def decref(self, blocks: Sequence[int]) -> None:
        # In reverse, so that a request's tail blocks are the first to go when evicting.
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block} freed more often than it was allocated")
            self.ref_counts[block] = count
            if count == 0:
                self._free[block] = None
                self._open[block] = self.keys[block] is None

    def register(self, block: int, key: BlockKey) -> None:
        """Make a computed, full block findable under `key` (unless another block already is)."""
        if key not in self.cached and self.keys[block] is None:
            self.cached[key] = block
            self.keys[block] = key

    def num_free_after_taking(self, blocks: Sequence[int]) -> int:
        return len(self._free) - sum(1 for b in blocks if self.ref_counts[b] == 0)

    def free_block_ids(self) -> list[int]:
        return list(self._free)
