"""Reading a GGUF file: its metadata as plain Python values, and its tensors as they are stored
(dense types as torch views of the memory map, block types as `BlockTensor`s of their bytes), or
expanded to float32 for tools that want plain values (export, rotary factors)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import re
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


# llama.cpp's gguf-split names its shards PREFIX-00001-of-00003.gguf (split.no counts from 0).
_SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def split_shard_paths(path: Path) -> list[Path] | None:
    """Every shard of the split file that `path` names by gguf-split's pattern (None: not a shard
    name); the paths are not checked here."""
    match = _SHARD_NAME.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    return [path.with_name(f"{match['prefix']}-{no:05d}-of-{count:05d}.gguf") for no in range(1, count + 1)]


def _read_header(path: Path) -> GGUFHeader:
    try:
        return GGUFHeader.read(path)
    except Exception as exc:  # a truncated, foreign or corrupt file
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


class GGUFFile:
    """A GGUF file: its header parsed at once, its tensor data memory-mapped (nothing is read or
    copied until asked).

    A file split by llama.cpp's gguf-split (`-00001-of-000NN.gguf`; the first shard holds the
    metadata and `split.count`, every shard some of the tensors, each with offsets into its own
    data section) is one GGUFFile: each shard is mapped on its own, so no byte is copied to join
    them. `path` may name any shard; it is the first one after opening."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        header = _read_header(self.path)
        shards = [(self.path, header)]
        if int(header.metadata.get("split.count", 1)) > 1 or int(header.metadata.get("split.no", 0)) > 0:
            shards = self._open_shards(header)
            self.path, header = shards[0]
        # name -> (the shard's path, where the tensor lies in it)
        self._tensors: dict[str, tuple[Path, TensorInfo]] = {}
        for shard_path, shard in shards:
            for info in shard.tensors:
                if info.name in self._tensors:
                    raise ModelLoadError(f"{shard_path}: tensor {info.name!r} is in two shards of the split file")
                self._tensors[info.name] = (shard_path, info)
        expected = header.metadata.get("split.tensors.count")
        if len(shards) > 1 and expected is not None and int(expected) != len(self._tensors):
            raise ModelLoadError(f"{self.path}: the split file's shards hold {len(self._tensors)} tensors, "
                                 f"its split.tensors.count says {expected}")
        # Every key/value pair: strings as str, numbers as int/float, arrays as lists.
        self.metadata: dict[str, Any] = {k: v for k, v in header.metadata.items() if k not in SPLIT_KEYS}
        self.shard_paths: list[Path] = [shard_path for shard_path, _ in shards]
        self._maps: dict[Path, np.memmap] = {}

    def _open_shards(self, header: GGUFHeader) -> list[tuple[Path, GGUFHeader]]:
        """Every shard's header, in order, checked against the first's split.count."""
        paths = split_shard_paths(self.path)
        if paths is None:
            raise ModelLoadError(f"{self.path} is one shard of a split GGUF file (split.count "
                                 f"{header.metadata.get('split.count')}), but its name is not gguf-split's "
                                 "PREFIX-00001-of-000NN.gguf, so its other shards cannot be found")
        count = len(paths)
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise ModelLoadError(f"{self.path}: the split file's shard(s) {', '.join(missing)} are missing "
                                 f"(a split file of {count} shards loads only with all of them)")
        shards = []
        for no, shard_path in enumerate(paths):
            shard = header if shard_path == self.path else _read_header(shard_path)
            meta = shard.metadata
            if int(meta.get("split.no", -1)) != no or int(meta.get("split.count", -1)) != count:
                raise ModelLoadError(f"{shard_path}: split.no {meta.get('split.no')} / split.count "
                                     f"{meta.get('split.count')} do not match its name (shard {no + 1} of {count})")
            shards.append((shard_path, shard))
        return shards

    def _data(self, name: str) -> np.ndarray:
        """The tensor's bytes in its shard's memory map: [rows, bytes of a row] (a vector: one row)."""
        path, info = self._tensors[name]
        mapped = self._maps.get(path)
        if mapped is None:
            mapped = self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        qtype = GGMLQuantizationType(info.ggml_type)
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        row_values = info.dims[0]
        rows = int(np.prod(info.dims[1:], dtype=np.int64)) if len(info.dims) > 1 else 1
        if row_values % block_values:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} has rows of {row_values} values, not whole "
                                 f"{qtype.name} blocks of {block_values}")
        row_bytes = row_values // block_values * block_bytes
        if info.offset + rows * row_bytes > mapped.shape[0]:
            raise ModelLoadError(f"{path}: tensor {info.name!r} runs past the end of the file (truncated?)")
        return mapped[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return GGMLQuantizationType(self._tensors[name][1].ggml_type)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape in PyTorch order (GGUF lists the fastest-moving dimension first)."""
        return tuple(int(d) for d in reversed(self._tensors[name][1].dims))

    def tensor(self, name: str) -> torch.Tensor | BlockTensor:
        """The tensor as the file stores it, in PyTorch shape order: a dense one as a torch view of
        the memory map (read-only: copy it before writing), a block one as its rows of blocks."""
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        info = self._tensors[name][1]
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
        data = self._data(name)
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
        _release_mapped_pages(self._data(name))
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
