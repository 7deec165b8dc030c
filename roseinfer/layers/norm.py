"""RMSNorm, optionally fused with the residual add that precedes it (as the Llama family uses it).

On the CPU both run as one C++ pass over each row (see cpu_kernels.py); elsewhere, or where the
kernels cannot be built, as PyTorch's rms_norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.layers.cpu_kernels import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernels_for(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x). May reuse the memory of `x` and `residual`.
        No residual yet (a decoder's first layer): (rms_norm(x), x)."""
        if residual is None:
            return self(x), x
        kernels = _kernels_for(x)
        if kernels is not None and residual.is_contiguous():
            kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return F.rms_norm(residual, (x.shape[-1],), self.weight, self.eps), residual


def _kernels_for(x: torch.Tensor):
    if x.device.type != "cpu" or not x.is_contiguous():
        return None
    return cpu_kernels()
