"""Rotary position embeddings (the "rotate half" layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math
from typing import Any

import torch

from roseinfer.errors import ModelLoadError


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
    """Computes cos/sin for the step's positions once; every layer applies them."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim / 2] each, broadcasting over heads."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; rotates the first half against the second."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
