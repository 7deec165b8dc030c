"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-request block tables,
reference counts, and the prefix cache. It knows nothing about tensors; the model runner owns the
memory.

Prefix caching. Once every token of a block has its K/V computed, the block is registered under a
key chained over the token ids of the whole prefix up to it: SHA-256 of (the key of the block
before, this block's token ids as little-endian int64), the first block chained to the root of its
request's `cache_salt` (32 zero bytes without one, else SHA-256 of b"cache_salt\0" + the salt in
UTF-8). A cryptographic hash because the cache is shared between callers: with a 64-bit `hash()`
a crafted prompt could collide with another tenant's prefix and read its K/V (vLLM's
CVE-2025-25183). The salt is vLLM's: requests share cached blocks only when their salts are equal,
so a tenant that sends its own secret salt can neither reuse nor time other tenants' prefixes. A
new request walks its prompt block by block and reuses every registered block it finds, so those
tokens are not computed again. A finished request's registered blocks stay in
the cache while free: the free queue is ordered so that blocks nobody can reuse are handed out
first, then registered ones, least recently released first (LRU). A block leaves the cache exactly
when it is handed out again.

The K/V of a token depend only on the model and the tokens before it, so the token ids are all a
key needs here (no adapters or images change K/V in this engine).

Placement. Decode attention reads each request's blocks in order, and memory streams far faster
through adjacent blocks than through scattered ones (the hardware prefetcher follows a stream, not
a block table). The pool is cut into one lane per sequence the scheduler may run at once: a
request starts at the first free lane and its next block is the one after its last while that
one is free and uncached, so requests decoding side by side each keep a run of adjacent blocks.
Lanes are reused lowest first, so memory that was never written stays untouched (the pool is
committed lazily, see the model runner). Which uncached block is handed out never changes what
the prefix cache keeps (see the free queue above).

Sliding windows. When every layer of the model attends only to its last `attention_span`
positions (Mistral, Qwen2 with a window on every layer), a block whose positions all fall before
the span of the next query is never read again: `allocate_slots` drops it from the request's table
(its place holds `RELEASED`, so a table stays indexed by position) and releases it to the pool,
where it stays cached like a finished request's block. A request then holds about
`(span + chunk) / block_size` blocks however long it grows. A model with both full-attention and
sliding layers (Gemma) has one `KVCacheManager` per KV cache group (common/kv_cache_spec.py), each
with its own pool, under a `HybridKVCacheManager`: the full group keeps every block, each sliding
group releases as above. The scheduler is handed the table with each released place filled by the
request's first live block: the attention kernels never read a place before the window, and the
PyTorch paths mask it.

Invariants (checked by `check_invariants`, exercised by a property test):
  * a block's reference count equals the number of block tables that hold it;
  * a block is in the free queue exactly when its reference count is zero;
  * the cache maps every key to one block that carries that key, and every block that carries a
    key is the one the cache maps it to;
  * when every request has been freed, every block is free (possibly still cached).
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


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the runner copies block `src` into `dst` before the step's forward."""

    src: int
    dst: int
    group: int = 0  # the KV cache group whose pool holds both (see HybridKVCacheManager)


@dataclass
class SlotPlan:
    """What `KVCacheManager.commit_slots` does for a request (see plan_slots)."""

    cached_blocks: list[int]  # a new table's cached start (RELEASED where out of the window)
    taken: list[int]  # of those, the blocks taken
    needed: int  # new blocks at the table's end
    copy_on_write: int | None  # the place of a shared block written to, replaced by a private copy


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


class KVCacheManager:
    """Block tables for requests, backed by one `BlockPool`."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, max_num_seqs: int = 1,
        attention_span: int | None = None, group: int = 0,
    ) -> None:
        self.block_size = block_size
        self.group = group  # its index among a hybrid manager's groups (named in its block copies)
        self.enable_prefix_caching = enable_prefix_caching
        # The last positions any layer reads (see Sliding windows above); None: all of them.
        self.attention_span = attention_span
        self.pool = BlockPool(num_blocks, lanes=max_num_seqs)
        self.block_tables: dict[int, list[int]] = {}
        self.prefix_stats = PrefixCacheStats()
        self._keys: dict[int, list[BlockKey]] = {}  # per request: keys of its full, computed blocks
        self._pending_copies: list[BlockCopy] = []

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted on demand)."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_table(self, request_id: int) -> list[int]:
        """The request's blocks by position; a released place (see Sliding windows) holds the
        request's first live block instead, a valid block the attention never reads there."""
        table = self.block_tables.get(request_id, [])
        if not table or table[0] != RELEASED:
            return table
        live = next((block for block in table if block != RELEASED), RELEASED)
        return [live if block == RELEASED else block for block in table]

    def _num_released(self, num_computed: int) -> int:
        """How many leading blocks no query at position >= `num_computed` reads: those wholly
        before its span (keys at positions > query - span)."""
        if self.attention_span is None:
            return 0
        return max(0, (num_computed - self.attention_span + 1) // self.block_size)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_tokens(self, cached_blocks: Sequence[int]) -> int:
        """How many prompt tokens the blocks `find_cached_prefix` found hold."""
        return len(cached_blocks) * self.block_size

    # -- prefix cache ---------------------------------------------------------------------
    def _chain(
        self, token_ids: Sequence[int], keys: list[BlockKey], num_full_blocks: int, cache_salt: str | None,
        variant: str | None = None,
    ) -> list[BlockKey]:
        """Extend `keys` (the first blocks' keys) to cover `num_full_blocks` blocks: one digest a
        block, over the token bytes converted once for all of them."""
        first = len(keys)
        if first >= num_full_blocks:
            return keys
        size = self.block_size
        data = np.asarray(token_ids[first * size : num_full_blocks * size], dtype=_TOKEN_BYTES).tobytes()
        step = size * _TOKEN_BYTES.itemsize
        parent = keys[-1] if keys else chain_root(cache_salt, variant)
        for offset in range(0, len(data), step):
            parent = hashlib.sha256(parent + data[offset : offset + step]).digest()
            keys.append(parent)
        return keys

    def find_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None = None, variant: str | None = None
    ) -> list[int]:
        """The cached blocks that hold the longest computed prefix of `token_ids`, among those
        registered under the same `cache_salt`.

        At least the last token is always left to compute (its logits are needed), so a block is
        only used if it ends before it; a prompt that is all cached recomputes its last block.
        """
        if not self.enable_prefix_caching:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        blocks: list[int] = []
        for key in self._chain(token_ids, [], usable, cache_salt, variant):
            block = self.pool.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count a lookup whose blocks were taken (for the hit-rate metrics)."""
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_cached_tokens

    def cache_computed_blocks(
        self, request_id: int, token_ids: Sequence[int], num_computed: int, cache_salt: str | None = None,
        variant: str | None = None,
    ) -> None:
        """Register the request's blocks that became full and computed (call after each step),
        under its `cache_salt`."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request_id)
        if not table:
            return
        keys = self._keys.setdefault(request_id, [])
        num_full = min(num_computed // self.block_size, len(table))
        first_new = len(keys)
        for index, key in enumerate(self._chain(token_ids, keys, num_full, cache_salt, variant)[first_new:], first_new):
            if table[index] != RELEASED:
                self.pool.register(table[index], key)

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self, request_id: int, num_computed: int, num_new: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Make room for `num_new` tokens written after `num_computed` cached ones.

        `cached_blocks` (from `find_cached_prefix`, for a request that holds no blocks yet) start
        its table. Allocates the blocks the new tokens need and, if the block they start in is
        shared with another request, replaces it by a private copy (copy-on-write). Blocks that
        fell out of the sliding window of every layer are released first (cached ones are not
        taken). Returns False, changing nothing else, when too few blocks are free.
        """
        plan = self.plan_slots(request_id, num_computed, num_new, cached_blocks)
        if plan is None:
            return False
        self.commit_slots(request_id, plan)
        return True

    def plan_slots(
        self, request_id: int, num_computed: int, num_new: int, cached_blocks: Sequence[int] = ()
    ) -> SlotPlan | None:
        """The check of `allocate_slots`: releases what fell out of the window, then returns what
        the rest needs, or None where too few blocks are free. A hybrid manager commits its groups'
        plans only when every group has one."""
        table = self.block_tables.get(request_id, [])
        if cached_blocks and table:
            raise RuntimeError(f"request {request_id} already has blocks; cached ones start a table")
        released = self._num_released(num_computed)
        if table:
            self._release(table, released)
        elif cached_blocks and released:
            cached_blocks = [RELEASED] * min(released, len(cached_blocks)) + list(cached_blocks[released:])
        have = len(table) + len(cached_blocks)
        needed = max(self.blocks_for_tokens(num_computed + num_new) - have, 0)
        first = num_computed // self.block_size
        cow = num_new > 0 and first < len(table) and self.pool.ref_counts[table[first]] > 1
        taken = [block for block in cached_blocks if block != RELEASED]
        if needed + int(cow) > self.pool.num_free_after_taking(taken):
            return None
        return SlotPlan(list(cached_blocks), taken, needed, first if cow else None)

    def commit_slots(self, request_id: int, plan: SlotPlan) -> None:
        """The allocation of `allocate_slots`, as `plan_slots` planned it."""
        table = self.block_tables.get(request_id, [])
        if plan.cached_blocks:
            self.pool.incref(plan.taken)
            table = plan.cached_blocks
        self.block_tables[request_id] = table
        first = plan.copy_on_write
        if first is not None:
            (copy,) = self.pool.allocate(1, after=table[first - 1] if first else None)
            self._pending_copies.append(BlockCopy(src=table[first], dst=copy, group=self.group))
            self.pool.decref([table[first]])
            table[first] = copy
            del self._keys.get(request_id, [])[first:]  # the copy is written to: not a cached block
        if plan.needed:
            table.extend(self.pool.allocate(plan.needed, after=table[-1] if table else None))

    def _release(self, table: list[int], count: int) -> None:
        """Release the table's first `count` blocks (the places stay, marked RELEASED)."""
        count = min(count, len(table))
        blocks = [block for block in table[:count] if block != RELEASED]
        if blocks:
            self.pool.decref(blocks)
            table[:count] = [RELEASED] * count

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (n > 1 sampling after one prefill)."""
        if child_id in self.block_tables:
            raise RuntimeError(f"request {child_id} already has a block table")
        parent = self.block_tables.get(parent_id, [])
        self.pool.incref([block for block in parent if block != RELEASED])
        self.block_tables[child_id] = list(parent)
        if parent_id in self._keys:
            self._keys[child_id] = list(self._keys[parent_id])

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past the first `num_tokens` tokens (rejected draft tokens'
        blocks). Those blocks were never registered in the prefix cache: only computed ones are."""
        table = self.block_tables.get(request_id)
        keep = self.blocks_for_tokens(num_tokens)
        if table and len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.pool.decref(tail)

    def free(self, request_id: int) -> None:
        table = self.block_tables.pop(request_id, None)
        self._keys.pop(request_id, None)
        if table:
            self.pool.decref([block for block in table if block != RELEASED])

    def take_pending_copies(self) -> list[BlockCopy]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds."""
        for key, block in list(self.pool.cached.items()):
            if self.pool.ref_counts[block] == 0:
                del self.pool.cached[key]
                self.pool.keys[block] = None

    # -- checks ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        pool = self.pool
        expected = [0] * pool.num_blocks
        for table in self.block_tables.values():
            for block in table:
                if block != RELEASED:
                    expected[block] += 1
        if expected != pool.ref_counts:
            raise AssertionError("reference counts differ from the block tables")
        free = pool.free_block_ids()
        if len(set(free)) != len(free):
            raise AssertionError("a block is in the free queue twice")
        if set(free) != {b for b, count in enumerate(expected) if count == 0}:
            raise AssertionError("the free queue differs from the blocks nobody holds")
        if any(pool.keys[block] != key for key, block in pool.cached.items()):
            raise AssertionError("a cache entry points to a block that carries another key")
        if sum(key is not None for key in pool.keys) != len(pool.cached):
            raise AssertionError("a block carries a key that the cache does not map to it")
        if pool._open.tolist() != [count == 0 and key is None for count, key in zip(expected, pool.keys, strict=True)]:
            raise AssertionError("the open-block map differs from the free, uncached blocks")


class HybridKVCacheManager:
    """Block tables for a model with full-attention and sliding-window layers: one `KVCacheManager`
    per KV cache group (common/kv_cache_spec.py), each over its own pool, the full group first.

    The scheduler sees one manager: a request gets room only when every group has it (else
    nothing changes and it waits or is preempted), and its block table is one table per group.
    Prefix caching keys are the same chained keys in every group (the same tokens give each
    group's layers the same K/V); a hit of L tokens needs the full group's blocks of the whole
    prefix and each sliding group's blocks of its window before L (see find_cached_prefix).
    """

    def __init__(self, groups: Sequence[KVCacheManager]) -> None:
        if len(groups) < 2 or groups[0].attention_span is not None:
            raise ValueError("a hybrid KV cache has a full-attention group first and at least one sliding group")
        self.groups = list(groups)
        self.block_size = groups[0].block_size
        self.enable_prefix_caching = groups[0].enable_prefix_caching
        self.prefix_stats = PrefixCacheStats()

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(group.num_blocks for group in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(group.num_free_blocks for group in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of all groups' blocks held by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: int) -> list[list[int]]:
        """One table per group (copies: the scheduler keeps what it sent)."""
        return [list(group.block_table(request_id)) for group in self.groups]

    def cached_tokens(self, cached_blocks: Sequence[Sequence[int]]) -> int:
        return len(cached_blocks[0]) * self.block_size if cached_blocks else 0

    # -- prefix cache ---------------------------------------------------------------------
    def find_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None = None, variant: str | None = None
    ) -> list[list[int]]:
        """Per group, the blocks of the longest prefix every group can start from: the full group
        needs all its blocks, a sliding group those its window reads after the prefix (RELEASED
        before them), so an evicted block inside a window shortens the hit (empty lists: none)."""
        none: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_prefix_caching:
            return none
        full = self.groups[0]
        usable = (len(token_ids) - 1) // self.block_size
        keys = full._chain(token_ids, [], usable, cache_salt, variant)
        found: list[int] = []
        for key in keys:
            block = full.pool.cached.get(key)
            if block is None:
                break
            found.append(block)
        # Per sliding group, each block's cached copy (or None), and how many cached blocks run
        # up to and including each place.
        sliding = [[group.pool.cached.get(key) for key in keys[: len(found)]] for group in self.groups[1:]]
        runs = []
        for blocks in sliding:
            run, count = [], 0
            for block in blocks:
                count = count + 1 if block is not None else 0
                run.append(count)
            runs.append(run)
        for hit in range(len(found), 0, -1):
            firsts = [group._num_released(hit * self.block_size) for group in self.groups[1:]]
            if all(run[hit - 1] >= hit - first for run, first in zip(runs, firsts, strict=True)):
                return [found[:hit]] + [[RELEASED] * first + blocks[first:hit]
                                        for blocks, first in zip(sliding, firsts, strict=True)]
        return none

    def record_prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_cached_tokens

    def cache_computed_blocks(
        self, request_id: int, token_ids: Sequence[int], num_computed: int, cache_salt: str | None = None,
        variant: str | None = None,
    ) -> None:
        for group in self.groups:
            group.cache_computed_blocks(request_id, token_ids, num_computed, cache_salt, variant)

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self, request_id: int, num_computed: int, num_new: int, cached_blocks: Sequence[Sequence[int]] = ()
    ) -> bool:
        """As KVCacheManager.allocate_slots, in every group or (returning False) in none."""
        cached = cached_blocks if cached_blocks and cached_blocks[0] else [()] * len(self.groups)
        plans = []
        for group, blocks in zip(self.groups, cached, strict=True):
            plan = group.plan_slots(request_id, num_computed, num_new, blocks)
            if plan is None:
                return False
            plans.append(plan)
        for group, plan in zip(self.groups, plans, strict=True):
            group.commit_slots(request_id, plan)
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        for group in self.groups:
            group.fork(parent_id, child_id)

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        for group in self.groups:
            group.free_tail(request_id, num_tokens)

    def free(self, request_id: int) -> None:
        for group in self.groups:
            group.free(request_id)

    def take_pending_copies(self) -> list[BlockCopy]:
        return [copy for group in self.groups for copy in group.take_pending_copies()]

    def reset_prefix_cache(self) -> None:
        for group in self.groups:
            group.reset_prefix_cache()

    # -- checks ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        for group in self.groups:
            group.check_invariants()
        tables = [group.block_tables for group in self.groups]
        if any(set(other) != set(tables[0]) for other in tables[1:]):
            raise AssertionError("a request holds a block table in some groups and not in others")
        if any(len(other[request]) != len(tables[0][request]) for other in tables[1:] for request in other):
            raise AssertionError("a request's block tables differ in length between groups")
