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
from gguf import GGMLQuantizationType, GGUFReader

from roseinfer.errors import ModelLoadError
from roseinfer.layers.quantization.gguf import (
    BLOCK_TYPES,
    DENSE_TYPES,
    BlockTensor,
    numpy_view,
    supported_type_names,
)

# Types roseinfer runs (dense ones as torch tensors, block ones in their own kernels); anything
# else is a clear error naming the tensor.
SUPPORTED_TENSOR_TYPES = frozenset((*DENSE_TYPES, *BLOCK_TYPES))


class GGUFFile:
    """A GGUF file opened with the `gguf` package (memory-mapped, nothing copied until asked)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as exc:  # gguf raises ValueError/struct errors on bad files
            raise ModelLoadError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        # Every key/value pair: strings as str, numbers as int/float, arrays as lists.
        self.metadata: dict[str, Any] = {
            key: field.contents() for key, field in self._reader.fields.items() if not key.startswith("GGUF.")
        }
        # The reader's parsed fields hold a numpy view per vocabulary string (~150 MB for a 49k
        # vocabulary), which would stay alive through the whole weight load.
        self._reader.fields = {}

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self._tensors[name].tensor_type)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape in PyTorch order (GGUF lists the fastest-moving dimension first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def tensor(self, name: str) -> torch.Tensor | BlockTensor:
        """The tensor as the file stores it, in PyTorch shape order: a dense one as a torch view of
        the memory map (read-only: copy it before writing), a block one as its rows of blocks."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} is stored as GGML type {qtype.name}, "
                f"which roseinfer cannot run (supported: {supported_type_names()})"
            )
        shape = self.tensor_shape(name)
        data = tensor.data  # a view of the memory map: [rows, bytes of a row] for block types
        if qtype in DENSE_TYPES:
            if qtype == GGMLQuantizationType.BF16:  # numpy has no bfloat16: its bits as int16
                return numpy_view(data.view(np.int16).reshape(shape)).view(torch.bfloat16)
            return numpy_view(data.reshape(shape))
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
        _release_mapped_pages(self._tensors[name].data)
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
