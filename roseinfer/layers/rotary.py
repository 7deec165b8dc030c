"""Rotary position embeddings, applied as one complex multiplication per tensor.

Hugging Face checkpoints rotate dimension i of a head against dimension i + head_dim/2. Models
here store q/k with each such pair adjacent instead (`interleave_rotary_rows` permutes the weight
rows once at load time; attention scores do not change, as q and k are permuted alike), so a
head is head_dim/2 complex numbers and rotating it is a single `*` instead of nine tensor ops.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from roseinfer.errors import ModelLoadError
from roseinfer.layers.cpu_kernels import cpu_kernels
from roseinfer.layers.quantization import permute_rows


def rope_inverse_frequencies(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with the model's scaling applied."""
    # Explicitly on the CPU: models are instantiated under a meta-device context.
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":  # GGUF files of Llama 3.1+ carry per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding:
    """Computes the step's rotations once from its positions; every layer applies them."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def rotations(self, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 1, head_dim / 2] complex64 unit rotations, broadcasting over heads."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.polar(torch.ones_like(angles), angles)[:, None, :]


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] with rotary pairs adjacent (see module docstring). On the
    CPU, with the C++ kernels, x is rotated in place (one pass, no float copies) and returned."""
    kernels = cpu_kernels() if x.device.type == "cpu" else None
    if kernels is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        kernels.rotary_embedding_(x, torch.view_as_real(rotations))
        return x
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)


def interleave_rotary_rows(weight, num_heads: int):
    """Reorder the rows (or entries) of a q/k projection from Hugging Face's half-split layout,
    [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] per head, to adjacent pairs [x_0, y_0, x_1, y_1, ...]
    (a dense tensor, or a checkpoint tensor of another format: see layers/quantization)."""

    def interleave(rows: torch.Tensor) -> torch.Tensor:
        head_dim = rows.shape[0] // num_heads
        halves = rows.reshape(num_heads, 2, head_dim // 2, *rows.shape[1:])
        return halves.transpose(1, 2).reshape(rows.shape)

    return permute_rows(weight, interleave)
