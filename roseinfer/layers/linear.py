"""Linear layers as the engine runs them, chosen once after the weights are loaded.

Models are written with plain `nn.Linear` (Hugging Face names, easy loading). `prepare_linear_layers`
then swaps every one of them for the kernel that suits the device and `--quantization`:

  none          CUDA: `F.linear`. CPU: oneDNN with the weight prepacked once into its blocked layout
                (the plain BLAS path repacks the weight on every call; prepacking is 1.2-1.8x faster
                at 4-64 rows here), same precision as the model's dtype.
  int8          weight-only int8, one scale per output channel (`_weight_int8pack_mm`).
  int4          weight-only int4, groups of 32 along the input with a scale and a minimum each
                (`_weight_int4pack_mm_for_cpu`); for GGUF Q4_0/Q4_1 weights these are the file's own
                groups. The LM head, the layer most sensitive to rounding (GGUF files keep it at 6-8
                bits), stays in the model's dtype: with it in per-channel int8 the default model's
                greedy tokens agree with float32 44% of the time, with it in float32 67%. Both
                weight-only kernels take bfloat16 activations on the CPU (their float32 paths are
                4-60x slower), so activations are rounded to bfloat16 for the product.
  dynamic-int8  int8 weights and int8 activations quantized per call (PyTorch's fbgemm kernels,
                VNNI): the fastest at every batch size on this CPU, the least exact.

The embedding stays as it is even when the LM head shares its weight: the head gets its own copy.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch
from torch import nn

from roseinfer.errors import InvalidRequestError

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("none", "int8", "int4", "dynamic-int8")
INT4_GROUP_SIZE = 32


class PrepackedLinear(nn.Module):
    """A float linear layer with its weight in oneDNN's blocked layout (CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class Int8WeightOnlyLinear(nn.Module):
    """int8 weights with one scale per output channel; the product in bfloat16."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        # The kernel wants bfloat16 scales: round them first, then the codes against what is kept.
        scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(torch.bfloat16)
        codes = torch.round(weight / scales.float()[:, None]).clamp(-127, 127)
        self.register_buffer("qweight", codes.to(torch.int8))
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


def quantize_int4_groups(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 per group: w ~ q * scale + minimum, q in 0..15.

    The same rule as GGUF's Q4_1, so weights that came from a Q4_1 file get their own codes back
    (they lie exactly on that grid; re-choosing codes against a rounded grid would lose that).
    Returns codes [N, K] int32, scales and minimums [N, K / group_size] float32.
    """
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    minimum = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - minimum) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - minimum[..., None]) / safe[..., None]).clamp(0, 15)
    return codes.reshape(rows, columns).to(torch.int32), scale, minimum


class Int4WeightOnlyLinear(nn.Module):
    """int4 weights in groups of 32 (a scale and a minimum per group); the product in bfloat16."""

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        codes, scale, minimum = quantize_int4_groups(linear.weight.detach(), group_size)
        # The kernel computes (q - 8) * scale + zero with bfloat16 scales and zeros (its only
        # choice with fast activations), so zero = minimum + 8 * scale, rounded.
        scales_and_zeros = torch.stack([scale, minimum + 8 * scale], dim=-1)  # [N, K/g, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed_weight, self.group_size, self.scales_and_zeros
        ).to(x.dtype)
        return out if self.bias is None else out + self.bias


class DynamicInt8Linear(nn.Module):
    """int8 weights (per channel) and activations quantized on the fly, with fbgemm's kernels."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # PyTorch marks its quantized tensors as deprecated
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        # VNNI multiplies int8 by int8 without saturating, so the full activation range is safe.
        self._reduce_range = not _has_vnni()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed, self._reduce_range).to(x.dtype)


def _has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as handle:
            flags = handle.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def _kernel_for(quantization: str, device: torch.device) -> Callable[[nn.Linear], nn.Module] | None:
    if device.type != "cpu":
        if quantization != "none":
            raise InvalidRequestError(
                f"quantization {quantization!r} has CPU kernels only; use --quantization none on {device}",
                "quantization",
            )
        return None
    return {
        "none": PrepackedLinear if torch.backends.mkldnn.is_available() else None,
        "int8": Int8WeightOnlyLinear,
        "int4": Int4WeightOnlyLinear,
        "dynamic-int8": DynamicInt8Linear,
    }[quantization]


def _supports(kind: Callable[[nn.Linear], nn.Module], linear: nn.Linear, dtype: torch.dtype) -> bool:
    if kind is PrepackedLinear:
        return dtype in (torch.float32, torch.bfloat16)
    if kind is Int4WeightOnlyLinear:
        return linear.in_features % INT4_GROUP_SIZE == 0 and linear.out_features % 16 == 0
    return True


def prepare_linear_layers(model: nn.Module, quantization: str, device: torch.device) -> int:
    """Replace every `nn.Linear` of a loaded model by the chosen kernel; returns how many."""
    if quantization not in QUANTIZATION_METHODS:
        raise InvalidRequestError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}",
            "quantization",
        )
    kind = _kernel_for(quantization, device)
    if kind is None:
        return 0
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            layer_kind = kind
            if kind is Int4WeightOnlyLinear and not parent_name and name == "lm_head":
                layer_kind = _kernel_for("none", device) or (lambda linear: linear)
            if not _supports(layer_kind, child, child.weight.dtype):
                logger.warning("%s (%d x %d) stays unquantized: its shape does not fit %s",
                               name, child.out_features, child.in_features, layer_kind.__name__)
                continue
            with torch.no_grad():
                setattr(parent, name, layer_kind(child))
            replaced += 1
    return replaced

