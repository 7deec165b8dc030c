"""The recurrent layers' state pools of a hybrid model (layers/recurrent) and each request's slot
in them.

Each recurrent layer gets `[num_slots, *shape]` of every state tensor its recurrence keeps per
sequence (from the model's RecurrentStateSpec; this module knows no recurrence). A request holds
one slot, the same in every recurrent layer, from its first scheduled step until it finishes; a
step's `state_slots` lists the slot of each sequence in batch order. A recomputed request (after
preemption) starts again from position 0, where the layers start from a zero state whatever the
slot holds.

Stopgap until the KV coordinator's recurrent-state group hands out the slots (one block-table
entry per request): until then the runner allocates them here, growing the pools when requests it
still knows (running or preempted) outnumber the slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roseinfer.layers.recurrent import RecurrentStateSpec


class RecurrentStatePools:
    def __init__(
        self, spec: RecurrentStateSpec, num_slots: int, dtype: torch.dtype, device: torch.device,
        zeros: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """`zeros(shape, dtype, device)`: how a pool is made (the runner's commits memory only where
        a slot is written)."""
        self.spec, self.dtype, self.device, self.zeros = spec, dtype, device, zeros
        self.pools = {layer: spec.allocate(num_slots, dtype, device, zeros) for layer in spec.layers}
        self.free = list(range(num_slots - 1, -1, -1))
        self.slots: dict[str, int] = {}

    @property
    def num_slots(self) -> int:
        return next(iter(self.pools.values()))[0].shape[0]

    def slot(self, req_id: str) -> int:
        """The request's slot, allocated at its first step."""
        slot = self.slots.get(req_id)
        if slot is None:
            if not self.free:
                self._grow()
            slot = self.slots[req_id] = self.free.pop()
        return slot

    def release(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)

    def _grow(self) -> None:
        old = self.num_slots
        for layer, tensors in self.pools.items():
            more = self.spec.allocate(old, self.dtype, self.device, self.zeros)
            self.pools[layer] = tuple(torch.cat([have, extra]) for have, extra in zip(tensors, more, strict=True))
        self.free = list(range(2 * old - 1, old - 1, -1))
