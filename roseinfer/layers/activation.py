"""The gated MLP's activation: SiLU(gate) * up (or GELU(gate) * up) over the fused gate/up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roseinfer.layers.cpu_kernels import cpu_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * width] (gate, then up) -> [..., width]. On the CPU, with the C++ kernels, one pass
    with no temporaries, rounded as the op-by-op path rounds."""
    kernels = cpu_kernels() if gate_up.device.type == "cpu" and gate_up.dtype != torch.float64 else None
    if kernels is not None and gate_up.is_contiguous():
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): GELU(gate, tanh approximation) * up over [..., 2 * width] (gate, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
