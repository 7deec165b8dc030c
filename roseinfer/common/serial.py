"""msgpack encoding of the engine's messages (common/messages.py), for ZeroMQ between processes.

A registered dataclass travels as an extension of its class name and its `__init__` fields, and
is rebuilt by calling the class (so `SamplingParams` is validated again on arrival); numpy arrays
travel as dtype, shape and bytes. Nothing is pickled: a peer can only make the registered classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from roseinfer.common import messages
from roseinfer.outputs import TokenLogprob
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams
from roseinfer.structured_output_params import StructuredOutputsParams

_DATACLASS = 1
_NDARRAY = 2

_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        messages.EngineCoreRequest, messages.EngineCoreOutput, messages.EngineCoreOutputs,
        messages.SchedulerStats, messages.SchedulerOutput, messages.NewRequestData,
        messages.CachedRequestData, messages.ModelRunnerOutput, messages.ReasoningSpec, messages.ImageInput,
        SamplingParams,
        TokenLogprob, StructuredOutputsParams, PoolingParams,
    )
}
_FIELDS = {name: [f.name for f in dataclasses.fields(cls) if f.init] for name, cls in _CLASSES.items()}


def register(cls: type) -> type:
    """Let another dataclass travel in messages (e.g. a structured-output spec)."""
    _CLASSES[cls.__name__] = cls
    _FIELDS[cls.__name__] = [f.name for f in dataclasses.fields(cls) if f.init]
    return cls


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def _default(obj: Any) -> Any:
    name = type(obj).__name__
    if name in _FIELDS and type(obj) is _CLASSES[name]:
        values = [getattr(obj, field) for field in _FIELDS[name]]
        return msgpack.ExtType(_DATACLASS, msgpack.packb([name, values], default=_default, use_bin_type=True))
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, msgpack.packb([array.dtype.str, list(array.shape), array.tobytes()]))
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"cannot send a {name} between processes")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _DATACLASS:
        name, values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
        cls = _CLASSES.get(name)
        if cls is None:
            raise ValueError(f"unknown message type {name!r}")
        return cls(**dict(zip(_FIELDS[name], values, strict=True)))
    if code == _NDARRAY:
        dtype, shape, buffer = msgpack.unpackb(data, raw=False)
        return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
    return msgpack.ExtType(code, data)
