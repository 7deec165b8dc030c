"""Reading a GGUF file: its metadata as plain Python values, and its tensors as they are stored
(dense types as torch views of the memory map, block types as `BlockTensor`s of their bytes), or
expanded to float32 for tools that want plain values (export, rotary factors)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from roseinfer.errors import ModelLoadError
from roseinfer.layers.quantization.gguf import (
    BLOCK_TYPES,
    DENSE_TYPES,
    BlockTensor,
    numpy_view,
    supported_type_names,
)
from roseinfer.models.gguf_header import GGUFHeader, TensorInfo

# Types roseinfer runs (dense ones as torch tensors, block ones in their own kernels, MXFP4
# included); anything else is a clear error naming the tensor.
SUPPORTED_TENSOR_TYPES = frozenset((*DENSE_TYPES, *BLOCK_TYPES))


class GGUFFile:
    """A GGUF file: its header parsed at once, its tensor data memory-mapped (nothing is read or
    copied until asked)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            header = GGUFHeader.read(self.path)
        except Exception as exc:  # a truncated, foreign or corrupt file
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self._tensors: dict[str, TensorInfo] = {t.name: t for t in header.tensors}
        # Every key/value pair: strings as str, numbers as int/float, arrays as lists.
        self.metadata: dict[str, Any] = header.metadata
        self._map: np.memmap | None = None

    def _data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes in the memory map: [rows, bytes of a row] (a vector: one row)."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        qtype = GGMLQuantizationType(info.ggml_type)
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        row_values = info.dims[0]
        rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        if row_values % block_values:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} has rows of {row_values} values, not whole "
                                 f"{qtype.name} blocks of {block_values}")
        row_bytes = row_values // block_values * block_bytes
        if info.offset + rows * row_bytes > self._map.shape[0]:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} runs past the end of the file (truncated?)")
        return self._map[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self._tensors[name].ggml_type)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape in PyTorch order (GGUF lists the fastest-moving dimension first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].dims))

    def tensor(self, name: str) -> torch.Tensor | BlockTensor:
        """The tensor as the file stores it, in PyTorch shape order: a dense one as a torch view of
        the memory map (read-only: copy it before writing), a block one as its rows of blocks."""
        info = self._tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has an unknown GGML type {info.ggml_type}") from None
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} is stored as GGML type {qtype.name}, "
                f"which roseinfer cannot run (supported: {supported_type_names()})"
            )
        shape = self.tensor_shape(name)
        data = self._data(info)
        if qtype in DENSE_TYPES:
            dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                     GGMLQuantizationType.BF16: np.int16}[qtype]  # numpy has no bfloat16: its bits
            values = numpy_view(data.view(dtype).reshape(shape))
            return values.view(torch.bfloat16) if qtype == GGMLQuantizationType.BF16 else values
        if len(shape) == 1:  # a vector in blocks (rare): its values
            return self._expanded(BlockTensor(qtype, numpy_view(data.reshape(1, -1)), shape[0])).reshape(shape)
        rows = int(np.prod(shape[:-1]))
        return BlockTensor(qtype, numpy_view(data.reshape(rows, -1)), shape[-1],
                           release=functools.partial(_release_mapped_pages, data))

    def load_tensor(self, name: str) -> torch.Tensor:
        """The tensor's values as float32, in PyTorch shape order (a copy; the file's pages are
        let go after)."""
        tensor = self.tensor(name)
        if isinstance(tensor, BlockTensor):
            return self._expanded(tensor).reshape(self.tensor_shape(name))
        values = tensor.to(torch.float32, copy=True)
        _release_mapped_pages(self._data(self._tensors[name]))
        return values

    @staticmethod
    def _expanded(tensor: BlockTensor) -> torch.Tensor:
        values = tensor.dequantize(torch.float32)
        if tensor.release is not None:
            tensor.release()
        return values


_MADV_DONTNEED = 4  # Linux
_RELEASE_SPAN = 2 * 1024 * 1024  # the largest page-cache folio a read fault maps at once (x86-64)


def _release_mapped_pages(view: np.ndarray) -> None:
    """Take a tensor's pages of the read-only memory map out of the process's resident memory
    once it has been read: they count in RSS for as long as the file is mapped, so by the end of a
    load the whole file (~100 MB for the default model) sat on top of the loaded weights, at the
    peak. The kernel's page cache keeps them; a later read maps them again."""
    if sys.platform != "linux":
        return
    base = view.base
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if not isinstance(base, np.memmap) or base.mode != "r" or view.nbytes == 0:
        return  # a private or writable mapping's pages are the only copy of its contents
    # Widened to the 2 MiB around it (within the map): a read fault maps the page cache's whole
    # folio (up to 2 MiB), so reading this tensor's first pages also mapped the previous one's last
    # pages, after they had been released (~7.5 MiB left over across the default model's tensors).
    # Releasing pages of a tensor not read yet is harmless: its read maps them again.
    start = max(view.ctypes.data // _RELEASE_SPAN * _RELEASE_SPAN, base.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE)
    end = min(-(-(view.ctypes.data + view.nbytes) // _RELEASE_SPAN) * _RELEASE_SPAN, base.ctypes.data + base.nbytes)
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
