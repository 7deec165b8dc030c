"""Linear layers as the engine runs them, chosen once after the weights are loaded.

Models are written with plain `nn.Linear` (Hugging Face names, easy loading). `prepare_linear_layers`
then swaps every one of them for the kernel that suits the device and `--quantization`:

  none          CUDA: `F.linear`. CPU: oneDNN with the weight prepacked once into its blocked layout
                (the plain BLAS path repacks the weight on every call; prepacking is 1.2-1.8x faster
                at 4-64 rows here), same precision as the model's dtype. On CPUs with AVX-512 but
                no AMX (AMD Zen 4/5), float32 and bfloat16 (with AVX512-BF16) weights run
                roseinfer's panel kernel instead (`PanelLinear`, csrc/panel_linear_cpu.cpp):
                1.1-1.75x oneDNN at 16-64 rows, 1.4-2.6x at one row; with AMX, oneDNN is kept.
  int8          weight-only 8-bit blocks of 32 along the input with a scale each (GGUF's Q8_0).
  int4          weight-only 4-bit blocks of 32 with a scale and a minimum each (GGUF's Q4_1; for
                Q4_0/Q4_1 files these are the file's own codes), and the LM head, the layer most
                sensitive to rounding, in 8-bit blocks (as GGUF files keep it at 6-8 bits).
                Both run `BlockQuantLinear`: float32 activations, blocks expanded in registers by the
                C++ kernels at decode batch sizes (see csrc/quant_linear_cpu.cpp). Against float32
                over the quality corpus (`roseinfer bench quality`), their KL divergence is below
                llama.cpp's for its Q4_1 file; the former bfloat16-activation kernels and the dynamic
                int8 (int8 activations) mode were dropped for falling behind it.

A tied LM head whose table is exactly 8-bit blocks (GGUF Q8_0, as the default model's) reads the
embedding's blocks in float32, int8 and int4 modes (`registry.share_tied_head_blocks`); otherwise
it gets its own copy of the table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from roseinfer.errors import InvalidRequestError
from roseinfer.layers.cpu_kernels import cpu_kernels

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32
INT8_GROUP_SIZE = 32


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


ROWS_PER_RUN = 4096  # weight rows converted at once (~10 MB of float32 at 576 columns)


def _by_row_runs(
    quantize: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]], weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, ...]:
    """`quantize` over runs of rows, its outputs put back together: a whole large matrix (an LM
    head) at once would hold several float32 copies of it at the peak of loading."""
    runs = [quantize(weight[start : start + ROWS_PER_RUN], group_size) for start in range(0, weight.shape[0], ROWS_PER_RUN)]
    return tuple(torch.cat(parts) for parts in zip(*runs, strict=True))


def quantize_int4_groups(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 per group: w ~ q * scale + minimum, q in 0..15.

    The same rule as GGUF's Q4_1, so weights that came from a Q4_1 file get their own codes back
    (they lie exactly on that grid; re-choosing codes against a rounded grid would lose that).
    Returns codes [N, K] int32, scales and minimums [N, K / group_size] float32.
    """
    return _by_row_runs(_int4_groups, weight, group_size)


def _int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    minimum = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - minimum) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - minimum[..., None]) / safe[..., None]).clamp(0, 15)
    return codes.reshape(rows, columns).to(torch.int32), scale, minimum


def quantize_int8_groups(weight: torch.Tensor, group_size: int = INT8_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per group: w ~ q * scale, q in -127..127 (GGUF's Q8_0 rule, so weights that
    came from a Q8_0 file get their own codes back). Returns codes [N, K] int8 and scales
    [N, K / group_size] float32."""
    return _by_row_runs(_int8_groups, weight, group_size)


def _int8_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / safe[..., None]).clamp(-127, 127)
    return codes.reshape(rows, columns).to(torch.int8), scale


def pack_nibbles(codes: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] bytes, GGUF's Q4_1 order: byte j of a group of 32 holds
    element j (low nibble) and element j + 16 (high nibble)."""
    rows, columns = codes.shape
    groups = codes.reshape(rows, columns // group_size, group_size).to(torch.uint8)
    half = group_size // 2
    return (groups[..., :half] | (groups[..., half:] << 4)).reshape(rows, columns // 2).contiguous()


class BlockQuantLinear(nn.Module):
    """Weights in blocks of 32 along the input: 4-bit codes with a scale and a minimum per block
    (`bits=4`, GGUF's Q4_1) or 8-bit codes with a scale (`bits=8`, GGUF's Q8_0); activations stay
    in float32. Small batches (decode) run the C++ kernels, which expand the blocks in registers and
    read each weight once per step; larger ones (prefill) expand the weight to float32 for a matrix
    product, which is faster there."""

    # Rows up to which the blocked kernel beats expanding the weight. On 2 cores with VNNI, the
    # default model's 30 layers: 16 rows 19 vs 240 ms, 64 rows 74 vs 99, 128 rows 142 vs 237, even
    # near 256 (the expansion writes the whole weight in float32 every call).
    SMALL_BATCH = 128

    def __init__(
        self,
        linear: nn.Linear,
        bits: int,
        quantize_activations: bool = True,
        blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`blocks`: 8-bit codes and scales already made for this weight (a tied LM head reads its
        embedding's own blocks), used as they are rather than copied."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits = bits
        # Where the C++ build has VNNI, small batches' activations are quantized to 8 bits per
        # block (csrc/quant_linear_cpu.cpp); the LM head, bound by reading its weights, opts out.
        self.quantize_activations = quantize_activations
        if blocks is not None:
            if bits != 8:
                raise ValueError("shared blocks are 8-bit blocks")
            codes, scales = blocks
            self.register_buffer("codes", codes)
            self.register_buffer("minimums", None)
        elif bits == 4:
            codes, scales, minimums = quantize_int4_groups(linear.weight.detach())
            self.register_buffer("codes", pack_nibbles(codes))
            self.register_buffer("minimums", minimums.contiguous())
        else:
            codes, scales = quantize_int8_groups(linear.weight.detach())
            self.register_buffer("codes", codes)
            self.register_buffer("minimums", None)
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self._kernels = cpu_kernels()
        # 8-bit blocks against float activations run as a blocked matrix product at any batch size
        # where the C++ build has it (AVX-512): as fast as a prepacked float32 weight past ~32 rows.
        self.float_matrix_kernel = (
            bits == 8 and not quantize_activations and self._kernels is not None and self._kernels.q8_float_gemm()
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] the layer multiplies by."""
        kernels = self._kernels
        if self.bits == 4:
            if kernels is not None:
                return kernels.q4_dequantize(self.codes, self.scales, self.minimums)
            low, high = (self.codes & 15).float(), (self.codes >> 4).float()
            groups = torch.cat([low.view(self.out_features, -1, 16), high.view(self.out_features, -1, 16)], -1)
            return (groups * self.scales[..., None] + self.minimums[..., None]).view(self.out_features, -1)
        if kernels is not None:
            return kernels.q8_dequantize(self.codes, self.scales)
        groups = self.codes.float().view(self.out_features, -1, INT8_GROUP_SIZE)
        return (groups * self.scales[..., None]).view(self.out_features, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        # With float activations the 8-bit kernel is a matrix product past a few rows (q8_gemm):
        # no batch size needs the whole weight expanded.
        kernel_serves = rows.shape[0] <= self.SMALL_BATCH or self.float_matrix_kernel
        if kernel_serves and self._kernels is not None:
            if self.bits == 4:
                out = self._kernels.q4_linear(rows, self.codes, self.scales, self.minimums)
            else:
                out = self._kernels.q8_linear(rows, self.codes, self.scales, self.quantize_activations)
        else:
            out = rows @ self.dequantized_weight().T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _kernel_for(quantization: str, device: torch.device) -> Callable[[nn.Linear], nn.Module] | None:
    if device.type != "cpu":
        if quantization != "none":
            raise InvalidRequestError(
                f"quantization {quantization!r} has CPU kernels only; use --quantization none on {device}",
                "quantization",
            )
        return None
    return {
        "none": float_linear if torch.backends.mkldnn.is_available() else None,
        "int8": partial(BlockQuantLinear, bits=8),
        "int4": partial(BlockQuantLinear, bits=4),
    }[quantization]


def _supports(kind: Callable[[nn.Linear], nn.Module], linear: nn.Linear, dtype: torch.dtype) -> bool:
    if kind is float_linear:
        return dtype in (torch.float32, torch.bfloat16)
    if isinstance(kind, partial) and kind.func is BlockQuantLinear:
        return linear.in_features % INT4_GROUP_SIZE == 0
    return True


class LinearLayerKernels:
    """Swaps a model's `nn.Linear` layers, one at a time (as each is loaded, or all at the end:
    `prepare_linear_layers`), for the kernel that suits the device and `--quantization`."""

    def __init__(self, quantization: str, device: torch.device) -> None:
        if quantization not in QUANTIZATION_METHODS:
            raise InvalidRequestError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}",
                "quantization",
            )
        self.quantization = quantization
        self.kind = _kernel_for(quantization, device)

    def prepare(self, model: nn.Module, module_name: str) -> bool:
        """Replace `model`'s module `module_name` if it is an `nn.Linear`; returns whether it did."""
        parent_name, _, name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, name)
        if self.kind is None or type(child) is not nn.Linear:
            return False
        kind = self.kind
        if not parent_name and name == "lm_head" and self.quantization in ("int4", "int8"):
            # The head, the layer most sensitive to rounding, gets 8-bit blocks (as GGUF files
            # keep it at 6-8 bits; the default model's head is Q8_0, so these are its own codes)
            # and float activations.
            kind = partial(BlockQuantLinear, bits=8, quantize_activations=False)
        if not _supports(kind, child, child.weight.dtype):
            logger.warning("%s (%d x %d) stays unquantized: its shape does not fit %s",
                           module_name, child.out_features, child.in_features, self.quantization)
            return False
        with torch.no_grad():
            setattr(parent, name, kind(child))
        return True


def prepare_linear_layers(model: nn.Module, quantization: str, device: torch.device) -> int:
    """Replace every `nn.Linear` of a loaded model by the chosen kernel; returns how many."""
    kernels = LinearLayerKernels(quantization, device)
    # Names only, not the layers: a list holding every old nn.Linear would keep all the original
    # weights alive until the last layer is converted (the model twice in memory).
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    return sum(kernels.prepare(model, name) for name in names)
