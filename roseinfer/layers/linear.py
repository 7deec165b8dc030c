"""Linear layers as the engine runs them: the one place that picks, per layer, how its weight is held
and applied, from the weight's format and `--quantization`.

Models are written with plain `nn.Linear` (Hugging Face names, easy loading); a checkpoint tensor
reaches the loader either dense (a torch tensor) or in a block format of its own
(`layers/quantization/gguf.py`: GGUF's Q4_0 ... Q6_K, IQ4_*). `LinearLayerKernels` then swaps each
`nn.Linear` for the kernel that suits:

  auto (default)  the checkpoint's own weights: GGUF blocks run in their own types and codes
                  (`BlockLinear`), dense weights in their dtype (`layers/quantization/dense.py`:
                  the panel kernel or oneDNN on the CPU).
  none            every weight expanded to --dtype and multiplied exactly (what transformers
                  computes; the token-exact tests use it). A GGUF embedding table keeps its blocks
                  (its rows are expanded exactly when looked up), and a tied float32 head reads them
                  with float activations: the same values, a quarter of the memory.
  int8 / int4     dense weights quantized once into GGUF Q8_0 / Q4_1 blocks (4-bit: the LM head, the
                  layer most sensitive to rounding, in Q8_0), then run as `BlockLinear`. A GGUF
                  file's blocks are expanded first and quantized again.

Block formats run on the CPU only; on CUDA, `auto` expands them to --dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from gguf import GGMLQuantizationType
from torch import nn

from roseinfer.config import QUANTIZATION_METHODS
from roseinfer.errors import InvalidRequestError
from roseinfer.heap import trim_heap
from roseinfer.layers.quantization.dense import PanelLinear, PrepackedLinear, float_linear
from roseinfer.layers.quantization.gguf import (
    BlockLinear,
    BlockTensor,
    PackedBlocks,
    block_kernels,
    pack_parts,
    quantize_to_blocks,
)

logger = logging.getLogger(__name__)

BLOCK_VALUES = 32  # int4 / int8 blocks: Q4_1 / Q8_0
_QUANTIZED_TYPES = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1}

__all__ = ["QUANTIZATION_METHODS", "BlockLinear", "LinearLayerKernels", "PanelLinear", "PrepackedLinear",
           "float_linear", "prepare_linear_layers"]

# The weight parts of one module as the loader hands them over: (first row, tensor) per part.
WeightParts = Sequence[tuple[int, BlockTensor]]


class LinearLayerKernels:
    """Swaps a model's `nn.Linear` layers, one at a time (as each is loaded, or all at the end:
    `prepare_linear_layers`), for the kernel that suits the device, the weight and `--quantization`."""

    def __init__(self, quantization: str, device: torch.device) -> None:
        if quantization not in QUANTIZATION_METHODS:
            raise InvalidRequestError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}",
                "quantization",
            )
        if device.type != "cpu" and quantization in _QUANTIZED_TYPES:
            raise InvalidRequestError(
                f"quantization {quantization!r} has CPU kernels only; use --quantization auto or none on {device}",
                "quantization",
            )
        self.quantization = quantization
        self.device = device
        self.on_cpu = device.type == "cpu"
        # Blocks run where the C++ kernels do; elsewhere they are expanded at load.
        self.blocks_run = self.on_cpu and block_kernels() is not None

    @property
    def keeps_file_blocks(self) -> bool:
        """Whether a checkpoint's block weights are run as they are."""
        return self.quantization == "auto" and self.blocks_run

    @property
    def quantizes(self) -> bool:
        return self.quantization in _QUANTIZED_TYPES

    def prepare(self, model: nn.Module, module_name: str, parts: WeightParts | None = None) -> bool:
        """Replace `model`'s module `module_name` if it is an `nn.Linear`; `parts`: its weight as
        it arrived in blocks. Returns whether it did (a dense weight expanded from blocks waits for
        the end of the load, as every dense weight does)."""
        parent_name, _, name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, name)
        if type(child) is not nn.Linear:
            return False
        with torch.no_grad():
            if parts:
                blocks = [tensor for _, tensor in sorted(parts, key=lambda part: part[0])]
                if self.keeps_file_blocks:
                    setattr(parent, name, BlockLinear(pack_parts(blocks), child.bias, exact=False))
                    return True
                # Expanded to the model's dtype, then served as a dense weight (or quantized again).
                weight = torch.cat([b.dequantize(child.weight.dtype) for b in blocks]).to(self.device)
                child.weight = nn.Parameter(weight, requires_grad=False)
                if not self.quantizes:
                    return False
            if self.quantizes:
                replacement = self._quantized(module_name, child, is_head=not parent_name and name == "lm_head")
                if replacement is not None:
                    setattr(parent, name, replacement)
                return replacement is not None
            return self._dense(parent, name, child)

    def _quantized(self, module_name: str, child: nn.Linear, is_head: bool) -> nn.Module | None:
        if child.in_features % BLOCK_VALUES:
            logger.warning("%s (%d x %d) stays unquantized: its input size is not a multiple of %d",
                           module_name, child.out_features, child.in_features, BLOCK_VALUES)
            return None
        # The head, the layer most sensitive to rounding, gets 8-bit blocks (as GGUF files keep it
        # at 6-8 bits).
        qtype = GGMLQuantizationType.Q8_0 if is_head else _QUANTIZED_TYPES[self.quantization]
        return BlockLinear(pack_parts([quantize_to_blocks(child.weight.detach(), qtype)]), child.bias, exact=False)

    def _dense(self, parent: nn.Module, name: str, child: nn.Linear) -> bool:
        """A dense weight's prepacked CPU kernel (the panel kernel or oneDNN); on the GPU `F.linear`
        stays. Called at the end of the load: a prepacked copy is as large as the weight, and made
        during the load the freed weights' holes raised the float32 peak by ~40 MiB."""
        if not self.on_cpu or not torch.backends.mkldnn.is_available():
            return False
        if child.weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        setattr(parent, name, float_linear(child))
        return True

    def embedding_blocks(self, parts: WeightParts) -> PackedBlocks | None:
        """How a vocabulary table that arrived in blocks is kept: its blocks (rows expanded exactly
        when looked up, in every mode) where they run, else None (expand it)."""
        if not self.blocks_run:
            return None
        return pack_parts([tensor for _, tensor in sorted(parts, key=lambda part: part[0])])[0]

    def tied_head(self, head: nn.Linear, table: PackedBlocks) -> nn.Module | None:
        """The LM head of a model whose head is its embedding table, kept as `table`'s blocks:
        reading them, or None where the head needs a dense copy of its own."""
        if self.quantization == "auto":
            return BlockLinear([table], None, exact=False)
        if self.quantization == "none":
            # float32: the blocks with float activations, exact products (a quarter of the memory of
            # a float32 copy, as fast at batch sizes). bfloat16's head is a bfloat16 product.
            return BlockLinear([table], None, exact=True) if head.weight.dtype == torch.float32 else None
        if table.qtype == GGMLQuantizationType.Q8_0:
            return BlockLinear([table], None, exact=False)  # int4/int8 heads are Q8_0: these already are
        return None


def prepare_linear_layers(model: nn.Module, quantization: str, device: torch.device) -> int:
    """Replace every `nn.Linear` of a loaded model by the chosen kernel; returns how many."""
    kernels = LinearLayerKernels(quantization, device)
    # Names only, not the layers: a list holding every old nn.Linear would keep all the original
    # weights alive until the last layer is converted (the model twice in memory).
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    prepared = 0
    for name in names:
        prepared += kernels.prepare(model, name)
        if device.type == "cpu":
            # Packed copies live in weight memory (csrc/weight_memory_cpu.cpp), not in the heap: give
            # back the freed float weight's pages before the next copy is written, or the load peaks
            # with the model twice in memory (float32 default model: 1,227 MiB for 736).
            trim_heap()
    return prepared
