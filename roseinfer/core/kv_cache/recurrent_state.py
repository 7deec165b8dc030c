"""The recurrent-state manager: a KV cache group of recurrent layers (Gated DeltaNet, Mamba2, short
convolutions), which keep one fixed-size state per sequence instead of a growing KV cache.

A request takes one state slot when it is admitted (its table in this group is `[slot]`, the same
slot in every layer of the group), keeps it while it runs, and gives it back when it finishes or is
preempted: a preempted request is recomputed from position 0, where the runner zeroes its slot
(worker/state_pools.py). Slots are handed out lowest first.

Snapshots for the prefix cache. A state cannot be rebuilt from cached KV blocks, so the manager
keeps copies of states at block boundaries in a bounded pool of snapshot slots (ids after the
sequences' slots, in the same state tensors). The coordinator asks for one when a step ends on a
block boundary of a prompt (`schedule_snapshot`): the runner copies the sequence's slot into the
snapshot slot after that step's forward (`take_saves`), and once the step is recorded the snapshot
is registered under the key of the block that ends at the boundary (`register_snapshots`, the same
chained keys as the KV blocks', block_pool.py). A new request whose cached KV prefix ends at a
registered boundary starts from it: its new slot is filled from the snapshot before the step's
forward (a copy in `take_pending_copies`, as the paged groups' copy-on-write). Snapshots are
evicted least recently used first when a new one needs a slot; one still waiting for its step is
held by its request and returned to the pool if the request ends first.

What a slot cannot do yet: be shared (a forked sequence would need the state before the prompt's
last token) or be rolled back (a rejected draft token stays in the state). The coordinator forks
no prompts for a model with a recurrent group, and the pool plan refuses speculative decoding.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from roseinfer.core.kv_cache.block_pool import BlockCopy, BlockKey


@dataclass
class StatePlan:
    """What `RecurrentStateManager.commit_slots` does for a request (see plan_slots)."""

    needed: int  # 1: a slot for a new request
    restore_from: int | None  # a snapshot slot its new slot starts from (a prefix hit)


class RecurrentStateManager:
    def __init__(self, num_slots: int, group: int = 0, num_snapshots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent state pool needs at least one slot, got {num_slots}")
        if num_snapshots < 0:
            raise ValueError(f"the number of state snapshots must be >= 0, got {num_snapshots}")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.group = group
        self.block_tables: dict[int, list[int]] = {}  # request -> [its slot]
        self._free = list(range(num_slots))  # a heap: the lowest free slot first
        # Snapshot slots: num_slots .. num_slots + num_snapshots - 1.
        self._free_snapshots = list(range(num_slots, num_slots + num_snapshots))  # a heap
        self.snapshots: OrderedDict[BlockKey, int] = OrderedDict()  # registered, least recently used first
        self._pending: dict[int, dict[int, int]] = {}  # request -> {boundary (tokens): snapshot slot}
        self._saves: list[BlockCopy] = []  # sequence slot -> snapshot slot, after this step's forward
        self._restores: list[BlockCopy] = []  # snapshot slot -> sequence slot, before it

    @property
    def num_blocks(self) -> int:
        return self.num_slots

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def total_slots(self) -> int:
        """Every slot the state pools need: the sequences' and the snapshots'."""
        return self.num_slots + self.num_snapshots

    def block_table(self, request_id: int) -> list[int]:
        return self.block_tables.get(request_id, [])

    # -- prefix cache ---------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                           variant: str | None = None) -> list[int]:
        return []  # the coordinator matches snapshots against its attention group's keys

    def snapshot(self, key: BlockKey) -> int | None:
        """The snapshot slot registered at the boundary that ends the block keyed `key`, if any."""
        return self.snapshots.get(key)

    def cache_computed_blocks(self, request_id: int, token_ids: Sequence[int], num_computed: int,
                              cache_salt: str | None = None, variant: str | None = None) -> None:
        pass  # see register_snapshots

    def schedule_snapshot(self, request_id: int, boundary: int) -> bool:
        """Keep the request's state after its first `boundary` tokens (a block boundary its step
        ends on): a snapshot slot (a free one, else the least recently used snapshot's) that the
        runner fills after the step. False where every snapshot slot waits for a step."""
        table = self.block_tables.get(request_id)
        if not table or boundary in self._pending.get(request_id, {}):
            return False
        if self._free_snapshots:
            slot = heapq.heappop(self._free_snapshots)
        elif self.snapshots:
            _, slot = self.snapshots.popitem(last=False)  # evicted: its key no longer leads to it
        else:
            return False
        self._pending.setdefault(request_id, {})[boundary] = slot
        self._saves.append(BlockCopy(src=table[0], dst=slot, group=self.group))
        return True

    def register_snapshots(self, request_id: int, keys: Sequence[BlockKey], block_size: int, num_computed: int) -> None:
        """Register the request's snapshots whose step is done (boundary <= `num_computed`) under
        the keys of the blocks they end (`keys`: the request's chained block keys)."""
        pending = self._pending.get(request_id)
        if not pending:
            return
        for boundary in [b for b in pending if b <= num_computed]:
            slot = pending.pop(boundary)
            index = boundary // block_size - 1
            key = keys[index] if index < len(keys) else None
            if key is None or key in self.snapshots:  # no key to find it by, or a copy is kept already
                heapq.heappush(self._free_snapshots, slot)
            else:
                self.snapshots[key] = slot

    def take_saves(self) -> list[BlockCopy]:
        """The snapshot copies the runner makes after this step's forward."""
        saves, self._saves = self._saves, []
        return saves

    # -- allocation -----------------------------------------------------------------------
    def plan_slots(self, request_id: int, num_computed: int, num_new: int,
                   cached_blocks: Sequence[int] = ()) -> StatePlan | None:
        """A slot for a new request (starting from the snapshot in `cached_blocks`, a prefix hit),
        none for a running one; None where no slot is free."""
        if cached_blocks and request_id in self.block_tables:
            raise RuntimeError(f"request {request_id} already has a state slot; a snapshot starts a new one")
        if len(cached_blocks) > 1 or any(slot < self.num_slots or slot >= self.total_slots for slot in cached_blocks):
            raise RuntimeError(f"request {request_id}: {list(cached_blocks)} is not one snapshot slot")
        needed = 0 if request_id in self.block_tables else 1
        if needed > len(self._free):
            return None
        return StatePlan(needed, cached_blocks[0] if cached_blocks else None)

    def commit_slots(self, request_id: int, plan: StatePlan) -> None:
        if plan.needed:
            slot = heapq.heappop(self._free)
            self.block_tables[request_id] = [slot]
            if plan.restore_from is not None:
                # The copy is made before this step's forward, before any save of this step could
                # reuse the snapshot slot (saves run after the forward).
                self._restores.append(BlockCopy(src=plan.restore_from, dst=slot, group=self.group))
                for key, snapshot in self.snapshots.items():
                    if snapshot == plan.restore_from:
                        self.snapshots.move_to_end(key)  # recently used
                        break

    def fork(self, parent_id: int, child_id: int) -> None:
        raise RuntimeError("a recurrent state cannot be shared between sequences (see recurrent_state.py)")

    def free_tail(self, request_id: int, num_tokens: int) -> None:
        pass  # the slot stays: one per sequence whatever its length

    def free(self, request_id: int) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            heapq.heappush(self._free, table[0])
        for slot in self._pending.pop(request_id, {}).values():  # never registered: nobody reads it
            heapq.heappush(self._free_snapshots, slot)

    def take_pending_copies(self) -> list[BlockCopy]:
        """Snapshots to copy into new requests' slots before this step's forward."""
        copies, self._restores = self._restores, []
        return copies

    def reset_prefix_cache(self) -> None:
        for slot in self.snapshots.values():
            heapq.heappush(self._free_snapshots, slot)
        self.snapshots.clear()

    def check_invariants(self) -> None:
        held = [table[0] for table in self.block_tables.values()]
        if any(len(table) != 1 for table in self.block_tables.values()):
            raise AssertionError("a request holds other than one recurrent state slot")
        if len(set(held)) != len(held):
            raise AssertionError("a recurrent state slot is held by two requests")
        if sorted(held + self._free) != list(range(self.num_slots)):
            raise AssertionError("the free slots and the held ones are not every slot once")
        if set(self._pending) - set(self.block_tables):
            raise AssertionError("a snapshot waits for a request that holds no slot")
        pending = [slot for slots in self._pending.values() for slot in slots.values()]
        snapshots = sorted(pending + list(self.snapshots.values()) + self._free_snapshots)
        if snapshots != list(range(self.num_slots, self.total_slots)):
            raise AssertionError("the free, pending and registered snapshot slots are not every snapshot slot once")
