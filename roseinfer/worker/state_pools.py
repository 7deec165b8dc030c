"""The recurrent layers' state pools: each layer's state tensors (layers/recurrent's
RecurrentStateSpec, one sequence's) times the slots, `[num_slots, *shape]` per tensor. The KV
coordinator hands out the slots (a recurrent group's block table is `[slot]`: the same slot in every
recurrent layer, from admission to finish or preemption); the runner zeroes a slot when a sequence
starts from position 0 (new, or recomputed after preemption), since it may hold a finished one's
state. Past the sequences' slots lie the prefix cache's snapshot slots, filled and read by `copy`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from roseinfer.layers.recurrent import RecurrentStateSpec


class StatePools:
    def __init__(
        self, spec: RecurrentStateSpec, num_slots: int, dtype: torch.dtype, device: torch.device,
        zeros: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """`zeros(shape, dtype, device)`: how a pool is made (the runner's commits memory only where
        a slot is written)."""
        self.device = device
        self.pools = {layer: spec.allocate(num_slots, dtype, device, zeros) for layer in spec.layers}

    def zero(self, slots: Sequence[int]) -> None:
        """Reset these slots' state in every layer (sequences that start at position 0)."""
        if not slots:
            return
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        for tensors in self.pools.values():
            for tensor in tensors:
                tensor.index_fill_(0, index, 0)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy slot src into slot dst in every layer, for each (src, dst): all read before any is
        written (a state saved into a snapshot slot, a snapshot restored into a sequence's slot)."""
        src = torch.tensor([pair[0] for pair in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([pair[1] for pair in pairs], dtype=torch.int64, device=self.device)
        for tensors in self.pools.values():
            for tensor in tensors:
                tensor.index_copy_(0, dst, tensor.index_select(0, src))
