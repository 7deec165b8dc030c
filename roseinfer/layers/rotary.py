"""Rotary position embeddings, applied as one complex multiplication per tensor.

Hugging Face checkpoints rotate dimension i of a head against dimension i + head_dim/2. Models
here store q/k with each such pair adjacent instead (`interleave_rotary_rows` permutes the weight
rows once at load time; attention scores do not change, as q and k are permuted alike), so a
head is head_dim/2 complex numbers and rotating it is a single `*` instead of nine tensor ops.

The scalings of the rotary angles (`rope_scaling` in a Hugging Face config, `rope.scaling.*` in a
GGUF file) are computed as transformers computes them; a kind not listed in `ROPE_SCALING_TYPES`
is an error naming it, never the default. Two of them also scale q and k (YaRN's and LongRoPE's
attention factor): the rotations then have that magnitude instead of 1. Partial rotary (Phi-4-mini
rotates the first 3/4 of each head) is the same complex multiplication with the pairs past the
rotary dimensions turned by angle 0, magnitude 1 (exactly the identity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from roseinfer.config import rope_scaling_type
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
    kind = rope_scaling_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":  # GGUF files of Llama 3.1+ carry per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    if kind in ROPE_SCALING_TYPES:  # yarn, longrope: they scale q and k too
        return rope_frequencies(head_dim, theta, scaling).inv_freq
    raise unsupported_rope_scaling(kind)


ROPE_SCALING_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def unsupported_rope_scaling(kind: object) -> ModelLoadError:
    return ModelLoadError(
        f"rope scaling type {kind!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}"
    )


@dataclass
class RopeFrequencies:
    """A rotary embedding's inverse frequencies over its rotary dimensions, and what scales q and k."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] float32
    attention_factor: float = 1.0  # YaRN's mscale, LongRoPE's attention factor
    # LongRoPE: the frequencies of sequences longer than `long_from` tokens (the original context).
    long_inv_freq: torch.Tensor | None = None
    long_from: int | None = None


def rope_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> RopeFrequencies:
    """Every scaling kind, as transformers' `ROPE_INIT_FUNCTIONS` computes it (`rotary_dim`: the
    dimensions rotated, head_dim times partial_rotary_factor)."""
    kind = rope_scaling_type(scaling)
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(rotary_dim, theta, scaling, max_position_embeddings)
    if kind in ("default", "linear", "llama3", "freq_factors"):
        return RopeFrequencies(rope_inverse_frequencies(rotary_dim, theta, scaling))
    raise unsupported_rope_scaling(kind)


def _original_context(scaling: dict[str, Any], max_position_embeddings: int | None) -> int:
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if not original:
        raise ModelLoadError(f"rope scaling {scaling.get('rope_type')!r} needs original_max_position_embeddings")
    return int(original)


def _scale_factor(scaling: dict[str, Any], original: int, max_position_embeddings: int | None) -> float:
    # Without an explicit factor, the ratio of the context lengths (Phi-3's configs, DeepSeek's).
    factor = scaling.get("factor")
    if factor is None:
        if not max_position_embeddings:
            raise ModelLoadError(f"rope scaling {scaling.get('rope_type')!r} needs a factor")
        factor = max_position_embeddings / original
    return float(factor)


def _yarn(dim: int, theta: float, scaling: dict[str, Any], max_positions: int | None) -> RopeFrequencies:
    original = _original_context(scaling, max_positions)
    factor = _scale_factor(scaling, original, max_positions)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    powers = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    # High frequencies (fast dimensions) kept, low ones divided by the factor, a ramp between.
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated
    return RopeFrequencies(inv_freq, float(attention_factor))


def _longrope(dim: int, theta: float, scaling: dict[str, Any], max_positions: int | None) -> RopeFrequencies:
    original = _original_context(scaling, max_positions)
    factor = _scale_factor(scaling, original, max_positions)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim

    def frequencies(key: str) -> torch.Tensor:
        factors = scaling.get(key)
        if factors is None or len(factors) != dim // 2:
            raise ModelLoadError(f"LongRoPE {key} must list {dim // 2} numbers (rotary dimensions / 2)")
        return 1.0 / (torch.as_tensor(factors, dtype=torch.float32, device="cpu") * theta**shape)

    return RopeFrequencies(frequencies("short_factor"), float(attention_factor),
                           frequencies("long_factor"), original)


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
    """Computes the step's rotations once from its positions; every layer applies them.

    `head_dim` (default: all of `inv_freq`'s dimensions) past the rotary ones are left as they are.
    LongRoPE's long frequencies apply to the tokens the caller marks `long` (see `long_rope`)."""

    def __init__(self, inv_freq: torch.Tensor, head_dim: int | None = None, attention_factor: float = 1.0,
                 long_inv_freq: torch.Tensor | None = None, long_from: int | None = None) -> None:
        pairs = (head_dim or 2 * inv_freq.shape[0]) // 2
        if pairs < inv_freq.shape[0]:
            raise ModelLoadError(f"rotary dimensions {2 * inv_freq.shape[0]} exceed head_dim {head_dim}")
        self.inv_freq = _pad(inv_freq, pairs)
        self.long_inv_freq = _pad(long_inv_freq, pairs) if long_inv_freq is not None else None
        self.long_from = long_from
        # Magnitudes: the attention factor on the rotated pairs, 1 on the others.
        self.magnitude = _pad(torch.full_like(inv_freq, attention_factor), pairs, 1.0)

    @classmethod
    def from_frequencies(cls, frequencies: RopeFrequencies, head_dim: int) -> RotaryEmbedding:
        return cls(frequencies.inv_freq, head_dim, frequencies.attention_factor,
                   frequencies.long_inv_freq, frequencies.long_from)

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq = self.inv_freq.to(device)
        self.magnitude = self.magnitude.to(device)
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(device)
        return self

    def rotations(self, positions: torch.Tensor, long: torch.Tensor | None = None) -> torch.Tensor:
        """[num_tokens, 1, head_dim / 2] complex64 rotations, broadcasting over heads (`long`:
        [num_tokens] bool, the tokens that take LongRoPE's long frequencies)."""
        inv_freq = self.inv_freq[None, :]
        if self.long_inv_freq is not None and long is not None:
            inv_freq = torch.where(long[:, None], self.long_inv_freq[None, :], inv_freq)
        angles = positions.to(torch.float32)[:, None] * inv_freq
        return torch.polar(self.magnitude.expand_as(angles), angles)[:, None, :]


def _pad(values: torch.Tensor, size: int, fill: float = 0.0) -> torch.Tensor:
    return torch.cat([values, values.new_full((size - values.shape[0],), fill)])


def long_rope(positions: torch.Tensor, num_prompt_tokens: torch.Tensor, long_from: int) -> torch.Tensor:
    """LongRoPE's choice for each token, as transformers makes it: a sequence computed in one pass
    uses the long frequencies when it is longer than the original context, so a prompt's tokens
    use them when the prompt is, and each later token when the sequence up to it is. (Keys already
    cached keep the frequencies they were rotated with, as in transformers' generate.)"""
    return torch.maximum(positions + 1, num_prompt_tokens) > long_from


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] with rotary pairs adjacent (see module docstring). On the
    CPU, with the C++ kernels, x is rotated in place (one pass, no float copies) and returned."""
    kernels = cpu_kernels() if x.device.type == "cpu" else None
    if kernels is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        kernels.rotary_embedding_(x, torch.view_as_real(rotations))
        return x
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)


def interleave_rotary_rows(weight, num_heads: int, rotary_dim: int | None = None):
    """Reorder the rows (or entries) of a q/k projection from Hugging Face's half-split layout,
    [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] per head, to adjacent pairs [x_0, y_0, x_1, y_1, ...]
    (a dense tensor, or a checkpoint tensor of another format: see layers/quantization). With
    partial rotary, d is `rotary_dim` and the head's rows past it stay where they are."""

    def interleave(rows: torch.Tensor) -> torch.Tensor:
        head_dim = rows.shape[0] // num_heads
        rotated = rotary_dim or head_dim
        heads = rows.reshape(num_heads, head_dim, *rows.shape[1:])
        halves = heads[:, :rotated].reshape(num_heads, 2, rotated // 2, *rows.shape[1:])
        pairs = halves.transpose(1, 2).reshape(num_heads, rotated, *rows.shape[1:])
        return torch.cat([pairs, heads[:, rotated:]], dim=1).reshape(rows.shape)

    return permute_rows(weight, interleave)
