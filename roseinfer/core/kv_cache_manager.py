"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-request block tables and
reference counts. It knows nothing about tensors; the model runner owns the memory.

Invariants (checked by `check_invariants`, exercised by a property test):
  * a block's reference count equals the number of block tables that hold it;
  * a block is in the free list exactly when its reference count is zero;
  * when every request has been freed, every block is free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: the runner copies block `src` into `dst` before the step's forward."""

    src: int
    dst: int


class BlockPool:
    """A free list of block ids with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for block in blocks:
            self.ref_counts[block] += 1

    def decref(self, blocks: list[int]) -> None:
        # Freed in reverse so that a request's tail blocks are reused first.
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block} freed more often than it was allocated")
            self.ref_counts[block] = count
            if count == 0:
                self._free.append(block)

    def free_block_ids(self) -> list[int]:
        return list(self._free)


class KVCacheManager:
    """Block tables for requests, backed by one `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self._pending_copies: list[BlockCopy] = []

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_table(self, request_id: int) -> list[int]:
        return self.block_tables.get(request_id, [])

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, request_id: int, num_computed: int, num_new: int) -> bool:
        """Make room for `num_new` tokens written after `num_computed` cached ones.

        Allocates the blocks the new tokens need and, if the block they start in is shared with
        another request, replaces it by a private copy (copy-on-write). Returns False, changing
        nothing, when too few blocks are free.
        """
        table = self.block_tables.setdefault(request_id, [])
        needed = self.blocks_for_tokens(num_computed + num_new) - len(table)
        first = num_computed // self.block_size
        cow = first < len(table) and self.pool.ref_counts[table[first]] > 1 and num_new > 0
        if max(needed, 0) + int(cow) > self.pool.num_free:
            if not table:
                del self.block_tables[request_id]
            return False
        if cow:
            (copy,) = self.pool.allocate(1)
            self._pending_copies.append(BlockCopy(src=table[first], dst=copy))
            self.pool.decref([table[first]])
            table[first] = copy
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (n > 1 sampling after one prefill)."""
        if child_id in self.block_tables:
            raise RuntimeError(f"request {child_id} already has a block table")
        parent = self.block_tables.get(parent_id, [])
        self.pool.incref(parent)
        self.block_tables[child_id] = list(parent)

    def free(self, request_id: int) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.decref(table)

    def take_pending_copies(self) -> list[BlockCopy]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- checks ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        expected = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block in table:
                expected[block] += 1
        if expected != self.pool.ref_counts:
            raise AssertionError("reference counts differ from the block tables")
        free = self.pool.free_block_ids()
        if len(set(free)) != len(free):
            raise AssertionError("a block is in the free list twice")
        if set(free) != {b for b, count in enumerate(expected) if count == 0}:
            raise AssertionError("the free list differs from the blocks nobody holds")
