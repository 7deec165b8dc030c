"""The GGUF block formats (GGML's Q4_0 ... Q6_K, IQ4_NL, IQ4_XS, MXFP4): how a checkpoint tensor in one
of them is held, sharded and applied.

- `BlockTensor`: a 2-D tensor as the file stores it (whole rows of blocks along the input
  dimension), with the few shape operations the model code's loaders apply to checkpoint tensors:
  row slices and permutations, block-aligned column slices (tensor parallelism), row
  concatenation. Nothing is dequantized.
- `BlockLinear`: a linear layer on such weights, run by the C++ driver (csrc/gguf_linear_cpu.cpp)
  in the file's own codes. A fused projection (q/k/v, gate/up) whose parts have different types
  (Q4_K_M files keep some v in Q6_K) keeps one weight per run of same-typed parts.
- `quantize_to_blocks`: float weights into Q4_1 / Q8_0 blocks (`--quantization int4|int8`).

Block bytes are moved to the kernels' layout once (`gguf_pack`: the file's bytes for the 256-value
types, so those stay views of the memory-mapped file; 32-value types regrouped by 4 blocks).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from roseinfer.errors import ModelLoadError
from roseinfer.layers.cpu_kernels import cpu_kernels

logger = logging.getLogger(__name__)

# The dense GGML types: read as torch tensors, never as blocks.
DENSE_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
# Every block type the C++ kernels run (gguf_blocks.h); the list a clear load error names.
BLOCK_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                 "MXFP4")
)


def supported_type_names() -> str:
    return ", ".join(t.name for t in (*DENSE_TYPES, *BLOCK_TYPES))


def block_kernels():
    """The C++ module when it runs GGUF blocks, else None (then blocks are expanded at load)."""
    kernels = cpu_kernels()
    return kernels if kernels is not None and hasattr(kernels, "gguf_linear") else None


@dataclass(frozen=True)
class BlockTensor:
    """A [rows, columns] checkpoint tensor in a GGML block type: `data` holds rows as the file does,
    uint8 [rows, bytes of a row]; `order`, if set, which of them (in which order) the tensor's rows
    are, so that row permutations compose without copying (a GGUF Llama's q/k rows are permuted
    twice on the way, back to where they were). `release` lets the file's pages go once the bytes
    have been copied elsewhere (a view of a memory map counts in the resident set while mapped)."""

    qtype: GGMLQuantizationType
    data: torch.Tensor
    columns: int
    transposed: bool = False  # GPT-2's Conv1D layout: only another .t() undoes it
    release: object = None  # callable() -> None, or None
    order: torch.Tensor | None = None  # int64 row indices into data

    @property
    def block_values(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.order is None else self.order.shape[0]

    @property
    def shape(self) -> torch.Size:
        shape = (self.rows, self.columns)
        return torch.Size(shape[::-1] if self.transposed else shape)

    def dim(self) -> int:
        return 2

    def t(self) -> BlockTensor:
        return replace(self, transposed=not self.transposed)

    def _rows_only(self, what: str) -> None:
        if self.transposed:
            raise ModelLoadError(f"{what} of a transposed {self.qtype.name} tensor is not supported")

    def _with_rows(self, rows: slice | torch.Tensor) -> BlockTensor:
        """The tensor's rows `rows` (a slice or indices into its current rows)."""
        if self.order is None and isinstance(rows, slice):
            return replace(self, data=self.data[rows])
        order = torch.arange(self.data.shape[0]) if self.order is None else self.order
        order = order[rows]
        if order.shape[0] == self.data.shape[0] and torch.equal(order, torch.arange(order.shape[0])):
            order = None
        return replace(self, order=order)

    def narrow(self, dim: int, start: int, length: int) -> BlockTensor:
        self._rows_only("slicing")
        if dim == 0:
            return self._with_rows(slice(start, start + length))
        if start % self.block_values or length % self.block_values:
            raise ModelLoadError(
                f"a shard of columns {start}:{start + length} cuts through {self.qtype.name} blocks of "
                f"{self.block_values} values: choose a tensor-parallel size that splits the layer at block "
                "boundaries (the blocks are sliced as the file holds them, whatever --quantization says)"
            )
        first, count = start // self.block_values * self.block_bytes, length // self.block_values * self.block_bytes
        return replace(self, data=self.data.narrow(1, first, count), columns=length)

    def __getitem__(self, rows: slice) -> BlockTensor:
        if not isinstance(rows, slice):
            raise TypeError("a BlockTensor is indexed by a slice of rows")
        self._rows_only("slicing")
        return self._with_rows(rows)

    def split(self, rows: int) -> tuple[BlockTensor, ...]:
        self._rows_only("splitting")
        return tuple(self._with_rows(slice(first, first + rows)) for first in range(0, self.rows, rows))

    def take_rows(self, index: torch.Tensor) -> BlockTensor:
        """Rows in the order of `index` (noted, not copied: see `order`)."""
        self._rows_only("reordering")
        return self._with_rows(index)

    def new_zeros(self, shape: Sequence[int]) -> BlockTensor:
        """Rows of zero blocks (every scale zero): vocabulary padding."""
        rows, columns = shape
        return BlockTensor(self.qtype, torch.zeros(rows, self.data.shape[1], dtype=torch.uint8), columns)

    def row_bytes(self) -> torch.Tensor:
        """uint8 [rows, bytes of a row] in the tensor's row order (a view where no reordering is due)."""
        return self.data if self.order is None else self.data.index_select(0, self.order)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact values, [rows, columns] (transposed back if it was)."""
        kernels = block_kernels()
        data = self.row_bytes()
        if kernels is not None and self.qtype in BLOCK_TYPES:
            packed, kernel_type = kernels.gguf_pack(data, int(self.qtype), self.columns)
            values = kernels.gguf_dequantize(packed, kernel_type, self.columns, None, dtype)
        else:
            from gguf.quants import dequantize

            values = torch.from_numpy(dequantize(data.contiguous().numpy(), self.qtype).reshape(self.rows, self.columns))
            values = values.to(dtype)
        return values.t() if self.transposed else values


def cat_rows(parts: Sequence[BlockTensor]) -> BlockTensor:
    first = parts[0]
    if any(p.qtype != first.qtype or p.columns != first.columns or p.transposed for p in parts):
        raise ModelLoadError("only untransposed blocks of one type and width are put together")
    return replace(first, data=torch.cat([p.row_bytes() for p in parts]), order=None)


def is_blocks(tensor: object) -> bool:
    return isinstance(tensor, BlockTensor)


# ------------------------------------------------------------------------------------------------
# Applying them
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedBlocks:
    """One weight in the kernels' layout: uint8 [rows, packed bytes of a row], and the id the C++
    kernels know that layout by (`kernel_type`: the GGML type's, or its interleaved
    layout's; see csrc/gguf_interleaved.h)."""

    qtype: GGMLQuantizationType
    packed: torch.Tensor
    columns: int
    kernel_type: int

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    @classmethod
    def pack(cls, tensor: BlockTensor) -> PackedBlocks:
        kernels = block_kernels()
        if kernels is None:
            raise ModelLoadError("GGUF blocks need roseinfer's C++ CPU kernels, which could not be built here")
        if tensor.qtype not in BLOCK_TYPES:
            raise ModelLoadError(f"no kernel runs GGML type {tensor.qtype.name}; roseinfer runs {supported_type_names()}")
        packed, kernel_type = kernels.gguf_pack(tensor.row_bytes(), int(tensor.qtype), tensor.columns, lasting=True)
        if packed.data_ptr() != tensor.data.data_ptr() and tensor.release is not None:
            tensor.release()  # repacked: the file's pages are not needed any more
        return cls(tensor.qtype, packed, tensor.columns, kernel_type)

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids`, exact (embedding lookups)."""
        return block_kernels().gguf_dequantize(self.packed, self.kernel_type, self.columns, ids, dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return block_kernels().gguf_dequantize(self.packed, self.kernel_type, self.columns, None, dtype)


def pack_parts(parts: Sequence[BlockTensor]) -> list[PackedBlocks]:
    """Adjacent parts of the same type put together (one matrix product), each run packed."""
    runs: list[list[BlockTensor]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    packed = []
    for run in runs:
        tensor = run[0] if len(run) == 1 else cat_rows(run)
        if len(run) > 1:
            for part in run:  # copied into the concatenation
                if part.release is not None:
                    part.release()
        packed.append(PackedBlocks.pack(tensor))
    return packed


class BlockLinear(nn.Module):
    """x @ W.T (+ bias) for W in GGUF blocks, as one or more row runs of one type each.

    `exact`: float activations and exact products (`--quantization none`, which must compute what
    the expanded weights compute); otherwise 8-bit activations at decode batch sizes (VNNI CPUs)
    and bfloat16 products for prefill (AVX512-BF16 CPUs), as llama.cpp trades exactness for speed.
    """

    def __init__(self, parts: Sequence[PackedBlocks], bias: torch.Tensor | None, exact: bool) -> None:
        super().__init__()
        columns = {p.columns for p in parts}
        if len(columns) != 1:
            raise ModelLoadError("the parts of one linear layer must share their input size")
        self.in_features = columns.pop()
        self.out_features = sum(p.rows for p in parts)
        self.parts = list(parts)
        for i, part in enumerate(self.parts):
            self.register_buffer(f"packed{i}", part.packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self.exact = exact
        self._kernels = block_kernels()

    @property
    def qtypes(self) -> list[GGMLQuantizationType]:
        return [p.qtype for p in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(p.packed.numel() for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.gguf_linear(
            x, [p.packed for p in self.parts], [p.kernel_type for p in self.parts], self.bias, self.exact
        )

    def extra_repr(self) -> str:
        types = "+".join(p.qtype.name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}, exact={self.exact}"


# ------------------------------------------------------------------------------------------------
# Float weights into blocks (--quantization int4 | int8)
# ------------------------------------------------------------------------------------------------

ROWS_PER_RUN = 4096  # weight rows converted at once (a whole LM head would hold several float copies)


def _halves(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.uint8).reshape(*values.shape, 2)


def _q8_0_rows(weight: torch.Tensor) -> torch.Tensor:
    """GGML's Q8_0 rule: per 32 values, d = max|w| / 127 (float16), q = round(w / d)."""
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // 32, 32)
    d = groups.abs().amax(-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([_halves(d), q], dim=-1).reshape(rows, -1)


def _q4_1_rows(weight: torch.Tensor) -> torch.Tensor:
    """GGML's Q4_1 rule: per 32 values, d = (max - min) / 15 and m = min (float16), q = round((w - m)
    / d); byte j holds value j (low nibble) and value j + 16 (high)."""
    rows, columns = weight.shape
    groups = weight.float().reshape(rows, columns // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    d = (high - low) / 15.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((groups - low[..., None]) * inverse[..., None]).clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_halves(d), _halves(low), nibbles], dim=-1).reshape(rows, -1)


_QUANTIZERS = {GGMLQuantizationType.Q8_0: _q8_0_rows, GGMLQuantizationType.Q4_1: _q4_1_rows}


def quantize_to_blocks(weight: torch.Tensor, qtype: GGMLQuantizationType) -> BlockTensor:
    """A float [rows, columns] weight (columns a multiple of 32) as Q8_0 or Q4_1 blocks."""
    rows_fn = _QUANTIZERS[qtype]
    with torch.no_grad():
        data = torch.cat([rows_fn(weight[i : i + ROWS_PER_RUN]) for i in range(0, weight.shape[0], ROWS_PER_RUN)])
    return BlockTensor(qtype, data.contiguous(), weight.shape[1])


def numpy_view(array: np.ndarray) -> torch.Tensor:
    """A torch view of a (read-only) numpy array: the memory map's bytes, never written."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": these tensors are only read
        return torch.from_numpy(array)
