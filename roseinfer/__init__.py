"""roseinfer: an LLM inference engine and OpenAI-compatible server on PyTorch.

Paged KV cache, continuous batching with chunked prefill and preemption, GGUF and Hugging Face
models, offline (`LLM`, `InferenceEngine`, `OfflineScheduler`) and online serving.

Names are imported lazily, so `import roseinfer.core.scheduler` does not load torch or a model.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# Transparent huge pages for PyTorch's large CPU allocations (weights, KV pool): zeroing the pool
# is several times faster and the TLB misses fewer. Read by PyTorch at its first large allocation.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "roseinfer.offline",
    "OfflineScheduler": "roseinfer.offline",
    "InferenceEngine": "roseinfer.engine",
    "EngineConfig": "roseinfer.config",
    "SamplingParams": "roseinfer.sampling_params",
    "Request": "roseinfer.request",
    "InferenceSession": "roseinfer.request",
    "RequestOutput": "roseinfer.outputs",
    "CompletionOutput": "roseinfer.outputs",
    "OutputDelta": "roseinfer.outputs",
    "TokenLogprob": "roseinfer.outputs",
    "RoseInferError": "roseinfer.errors",
    "InvalidRequestError": "roseinfer.errors",
    "ModelLoadError": "roseinfer.errors",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InferenceEngine",
    "InferenceSession",
    "InvalidRequestError",
    "ModelLoadError",
    "OfflineScheduler",
    "OutputDelta",
    "Request",
    "RequestOutput",
    "RoseInferError",
    "SamplingParams",
    "TokenLogprob",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'roseinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from roseinfer.config import EngineConfig
    from roseinfer.engine import InferenceEngine
    from roseinfer.errors import InvalidRequestError, ModelLoadError, RoseInferError
    from roseinfer.offline import LLM, OfflineScheduler
    from roseinfer.outputs import CompletionOutput, OutputDelta, RequestOutput, TokenLogprob
    from roseinfer.request import InferenceSession, Request
    from roseinfer.sampling_params import SamplingParams
