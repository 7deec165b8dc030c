"""What a recurrent layer keeps per sequence, as plain data: the KV-cache group of a hybrid model's
recurrent layers (the KV coordinator gives each request one state slot in it) and, per layer, the
state tensors of one sequence. The model runner allocates `[num_slots, *shape]` of each tensor per
layer from this, without knowing the recurrence.

(Lives here until the shared KV-cache specs move to roseinfer/common/.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StateTensorSpec:
    """One state tensor of one sequence in one layer (a convolution's last inputs, a recurrence's
    matrix). `dtype` None: the model's activation dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None = None

    def torch_dtype(self, activations: torch.dtype) -> torch.dtype:
        return activations if self.dtype is None else _DTYPES[self.dtype]

    def bytes(self, activations: torch.dtype) -> int:
        elements = 1
        for size in self.shape:
            elements *= size
        return elements * torch.tensor([], dtype=self.torch_dtype(activations)).element_size()


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The recurrent layers of a model (all of one recurrence, `kind`, a name of the registry in
    layers/recurrent/__init__.py) and the state each keeps per sequence."""

    kind: str
    layers: tuple[int, ...]  # model layer indices
    tensors: tuple[StateTensorSpec, ...]  # of one sequence in one layer

    def slot_bytes(self, activations: torch.dtype) -> int:
        """Bytes one sequence's slot takes across all the group's layers."""
        return len(self.layers) * sum(tensor.bytes(activations) for tensor in self.tensors)

    def allocate(
        self, num_slots: int, activations: torch.dtype, device: torch.device, zeros: Callable[..., torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """One layer's state pool: a zeroed `[num_slots, *shape]` tensor per state tensor (made by
        `zeros(shape, dtype, device)`, e.g. one whose pages are committed only when written)."""
        zeros = zeros or (lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
        return tuple(zeros((num_slots, *tensor.shape), tensor.torch_dtype(activations), device)
                     for tensor in self.tensors)
