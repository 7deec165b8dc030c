"""A GGUF file's header: its key/value metadata and its tensors' names, types, shapes and offsets.

`gguf`'s own `GGUFReader` parses the header into a numpy view per array element: for a 49k-token
vocabulary and its merges, ~4 s per open of a 1B model's file (three opens per start: tokenizer,
configuration, weights), which was most of a load. The format is a flat sequence of typed values
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), read here in one pass with `struct`;
numeric arrays come out of numpy in bulk. Little-endian files only (all current writers).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value type -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the fastest-moving dimension first
    ggml_type: int
    offset: int  # from the start of the file


class _Cursor:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.at)
        except struct.error as exc:
            raise GGUFFormatError(f"the header ends early at byte {self.at}") from exc
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.at + length
        if end > len(self.data):
            raise GGUFFormatError(f"a string of {length} bytes at byte {self.at} runs past the file")
        value = bytes(self.data[self.at : end]).decode("utf-8")
        self.at = end
        return value

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type][0])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
                end = self.at + count * dtype.itemsize
                if end > len(self.data):
                    raise GGUFFormatError(f"an array of {count} values at byte {self.at} runs past the file")
                values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at).tolist()
                self.at = end
                return values
            return [self.value(item_type) for _ in range(count)]
        raise GGUFFormatError(f"unknown value type {value_type} at byte {self.at}")


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int  # where the tensor data section starts

    @classmethod
    def read(cls, path: Path) -> GGUFHeader:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)  # only the header's pages are read
            try:
                return cls._parse(_Cursor(view))
            finally:
                view.release()

    @classmethod
    def _parse(cls, cursor: _Cursor) -> GGUFHeader:
        if cursor.unpack("4s") != _MAGIC:
            raise GGUFFormatError("no GGUF magic at the start")
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (byte-swapped: a big-endian file?); version 2 or 3 is read")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_offset = -(-cursor.at // alignment) * alignment
        tensors = [TensorInfo(name, dims, ggml_type, data_offset + offset) for name, dims, ggml_type, offset in infos]
        return cls(version, metadata, tensors, data_offset)
