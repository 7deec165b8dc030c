"""Dense weights (float32, bfloat16, float16): how a linear layer on them runs on the CPU.

oneDNN with the weight prepacked once into its blocked layout (the plain BLAS path repacks the
weight on every call; prepacking is 1.2-1.8x faster at 4-64 rows here), in the model's dtype. On
CPUs with AVX-512 but no AMX (AMD Zen 4/5), float32 and bfloat16 (with AVX512-BF16) weights run
roseinfer's panel kernel instead (`PanelLinear`, csrc/panel_linear_cpu.cpp): 1.1-1.75x oneDNN at
16-64 rows, 1.4-2.6x at one row; with AMX, oneDNN is kept. On CUDA, `F.linear` as the model has it.
"""

from __future__ import annotations

import torch
from torch import nn

from roseinfer.layers.cpu_kernels import cpu_kernels


class PrepackedLinear(nn.Module):
    """A float linear layer with its weight in oneDNN's blocked layout (CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class PanelLinear(nn.Module):
    """A float32 or bfloat16 linear layer with its weight packed once into the panel kernel's
    layout (CPUs with AVX-512 and no AMX; see csrc/panel_linear_cpu.cpp)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        kernels = cpu_kernels()
        assert kernels is not None
        self._linear = kernels.panel_linear
        self.register_buffer("panels", kernels.pack_panels(linear.weight.detach()))
        # The kernel adds the bias in float32 before its one rounding, over whole panels.
        bias = None
        if linear.bias is not None:
            bias = torch.zeros(self.panels.shape[0] * self.panels.shape[2])
            bias[: self.out_features] = linear.bias.detach().float()
        self.register_buffer("panel_bias", bias)

    @staticmethod
    def suits(linear: nn.Linear) -> bool:
        kernels = cpu_kernels()
        dtype = linear.weight.dtype
        return (
            kernels is not None
            and str(dtype).removeprefix("torch.") in kernels.panel_linear_dtypes()
            and (dtype == torch.float32 or linear.in_features % 2 == 0)  # bfloat16 steps by pairs
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.panels, self.panel_bias, self.out_features)


def float_linear(linear: nn.Linear) -> nn.Module:
    """`--quantization none` on the CPU: the panel kernel where it suits, else oneDNN."""
    return PanelLinear(linear) if PanelLinear.suits(linear) else PrepackedLinear(linear)
