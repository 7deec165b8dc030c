"""The recurrent-state manager: a KV cache group of recurrent layers (Gated DeltaNet, Mamba2, short
convolutions), which keep one fixed-size state per sequence instead of a growing KV cache.

A request takes one state slot when it is admitted (its table in this group is `[slot]`, the same
slot in every layer of the group), keeps it while it runs, and gives it back when it finishes or is
preempted: a preempted request is recomputed from position 0, where the runner zeroes its slot
(worker/state_pools.py). Slots are handed out lowest first.

What a slot cannot do yet: be shared (a forked sequence would need the state before the prompt's
last token, which no one kept), be found by the prefix cache (no snapshots at block boundaries), or
be rolled back (a rejected draft token stays in the state). The coordinator therefore reports no
prefix hits and no forks for a model with a recurrent group, and the pool plan refuses
speculative decoding for it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from roseinfer.core.kv_cache.block_pool import BlockCopy


class RecurrentStateManager:
    def __init__(self, num_slots: int, group: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.group = group
        self.block_tables: dict[int, list[int]] = {}  # request -> [its slot]
        self._free = list(range(num_slots))  # a heap: the lowest free slot first

    @property
    def num_blocks(self) -> int:
        return self.num_slots

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, request_id: int) -> list[int]:
        return self.block_tables.get(request_id, [])

    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                           variant: str | None = None) -> list[int]:
        return []  # no state snapshots: nothing can be resumed

    def cache_computed_blocks(self, request_id: int, token_ids: Sequence[int], num_computed: int,
                              cache_salt: str | None = None, variant: str | None = None) -> None:
        pass

    def plan_slots(self, request_id: int, num_computed: int, num_new: int,
                   cached_blocks: Sequence[int] = ()) -> int | None:
        """How many slots the request needs (1 at admission, else 0), or None where none is free."""
        if cached_blocks:
            raise RuntimeError(f"request {request_id}: recurrent state has no cached blocks to start from")
        needed = 0 if request_id in self.block_tables else 1
        return None if needed > len(self._free) else needed

    def commit_slots(self, request_id: int, needed: int) -> None:
        if needed:
            self.block_tables[request_id] = [heapq.heappop(self._free)]

    def fork(self, parent_id: int, child_id: int) -> None:
        raise RuntimeError("a recurrent state cannot be shared between sequences (see recurrent_state.py)")

    def free_tail(self, request_id: int, num_tokens: int) -> None:
        pass  # the slot stays: one per sequence whatever its length

    def free(self, request_id: int) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            heapq.heappush(self._free, table[0])

    def take_pending_copies(self) -> list[BlockCopy]:
        return []

    def reset_prefix_cache(self) -> None:
        pass

    def check_invariants(self) -> None:
        held = [table[0] for table in self.block_tables.values()]
        if any(len(table) != 1 for table in self.block_tables.values()):
            raise AssertionError("a request holds other than one recurrent state slot")
        if len(set(held)) != len(held):
            raise AssertionError("a recurrent state slot is held by two requests")
        if sorted(held + self._free) != list(range(self.num_slots)):
            raise AssertionError("the free slots and the held ones are not every slot once")
