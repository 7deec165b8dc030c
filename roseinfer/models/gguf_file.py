"""Reading a GGUF file: its metadata as plain Python values and its tensors as torch tensors."""

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
from gguf.quants import dequantize

from roseinfer.errors import ModelLoadError

# Types roseinfer dequantizes on load; anything else gets a clear error.
SUPPORTED_TENSOR_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)

_ROWS_PER_RUN = 4096  # rows dequantized at once (~10 MB of float32 at 576 columns)


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

    def load_tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in PyTorch shape order."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} is stored as GGML type {qtype.name}, "
                f"which roseinfer cannot load (supported: {supported})"
            )
        shape = self.tensor_shape(name)
        data = tensor.data  # a view of the memory map: [rows, bytes of a row] for block types
        # A fresh array (F32 tensors come back as read-only views of the memory map), filled a
        # run of rows at a time: dequantizing a whole embedding table at once would hold several
        # float32 copies of it (numpy's intermediates) at the peak of loading.
        array = np.empty(shape, dtype=np.float32)
        if data.ndim >= 2 and data.shape[0] == shape[0]:
            for start in range(0, shape[0], _ROWS_PER_RUN):
                end = min(start + _ROWS_PER_RUN, shape[0])
                array[start:end] = dequantize(data[start:end], qtype).reshape(end - start, *shape[1:])
        else:
            array[...] = dequantize(data, qtype).reshape(shape)
        _release_mapped_pages(data)
        return torch.from_numpy(array)


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
