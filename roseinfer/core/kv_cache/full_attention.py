"""The full-attention manager: a request's paged block table over one `BlockPool` (block_pool.py),
with the prefix cache, copy-on-write for forked sequences, and the release of blocks behind a
window when every layer of the model has one.

Prefix hits. A new request walks its prompt block by block (the chained keys of block_pool.py) and
reuses every registered block it finds, so those tokens are not computed again.

Sliding windows on every layer. When every layer of the model attends only to its last
`attention_span` positions (Mistral, Qwen2 with a window on every layer), a block whose positions
all fall before the span of the next query is never read again: `allocate_slots` drops it from the
request's table (its place holds `RELEASED`, so a table stays indexed by position) and releases it
to the pool, where it stays cached like a finished request's block. A request then holds about
`(span + chunk) / block_size` blocks however long it grows. `block_table` hands the table out with
each released place filled by the request's first live block: the attention kernels never read a
place before the window, and the PyTorch paths mask it. (A sliding group beside full-attention
layers, Gemma's, is sliding_window.py's manager.)

Invariants (checked by `check_invariants`, exercised by a property test):
  * a block's reference count equals the number of block tables that hold it;
  * a block is in the free queue exactly when its reference count is zero;
  * the cache maps every key to one block that carries that key, and every block that carries a
    key is the one the cache maps it to;
  * when every request has been freed, every block is free (possibly still cached).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from roseinfer.core.kv_cache.block_pool import (
    RELEASED,
    BlockCopy,
    BlockKey,
    BlockPool,
    chain_keys,
)


@dataclass
class SlotPlan:
    """What `KVCacheManager.commit_slots` does for a request (see plan_slots)."""

    cached_blocks: list[int]  # a new table's cached start (RELEASED where out of the window)
    taken: list[int]  # of those, the blocks taken
    needed: int  # new blocks at the table's end
    copy_on_write: int | None  # the place of a shared block written to, replaced by a private copy


class KVCacheManager:
    """Block tables for requests, backed by one `BlockPool`: a KV cache group of full-attention
    layers (or, with `attention_span`, of layers that all have that window)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, max_num_seqs: int = 1,
        attention_span: int | None = None, group: int = 0,
    ) -> None:
        self.block_size = block_size
        self.group = group  # its index among the coordinator's groups (named in its block copies)
        self.enable_prefix_caching = enable_prefix_caching
        # The last positions any layer reads (see Sliding windows above); None: all of them.
        self.attention_span = attention_span
        self.pool = BlockPool(num_blocks, lanes=max_num_seqs)
        self.block_tables: dict[int, list[int]] = {}
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
        return chain_keys(token_ids, keys, num_full_blocks, self.block_size, cache_salt, variant)

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
        return self.cached_run(self.prefix_keys(token_ids, cache_salt, variant))

    def prefix_keys(self, token_ids: Sequence[int], cache_salt: str | None, variant: str | None) -> list[BlockKey]:
        """The keys of the blocks a prefix hit may use: those that end before the last token."""
        return self._chain(token_ids, [], (len(token_ids) - 1) // self.block_size, cache_salt, variant)

    def block_keys(self, request_id: int) -> list[BlockKey]:
        """The keys of the request's blocks registered so far (full and computed), in order."""
        return self._keys.get(request_id, [])

    def cached_run(self, keys: Sequence[BlockKey]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first."""
        blocks: list[int] = []
        for key in keys:
            block = self.pool.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

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
        the rest needs, or None where too few blocks are free. The coordinator commits its groups'
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
