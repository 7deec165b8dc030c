"""roseinfer: an LLM inference engine and OpenAI-compatible server on PyTorch.

Paged KV cache, continuous batching with chunked prefill and preemption, GGUF and Hugging Face
models, offline (`LLM`, `LLMEngine`) and online (`AsyncLLM` behind an OpenAI-compatible server) serving.

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
    "LLM": "roseinfer.engine.llm",
    "LLMEngine": "roseinfer.engine.llm_engine",
    "AsyncLLM": "roseinfer.engine.async_llm",
    "EngineConfig": "roseinfer.config",
    "SamplingParams": "roseinfer.sampling_params",
    "RequestOutputKind": "roseinfer.sampling_params",
    "RequestOutput": "roseinfer.outputs",
    "CompletionOutput": "roseinfer.outputs",
    "TokenLogprob": "roseinfer.outputs",
    "PoolingParams": "roseinfer.pooling_params",
    "PoolingOutput": "roseinfer.outputs",
    "PoolingRequestOutput": "roseinfer.outputs",
    "Request": "roseinfer.core.request",
    # The seed's names (roseinfer/seed_api.py, on top of LLM / LLMEngine / AsyncLLM).
    "InferenceEngine": "roseinfer.seed_api",
    "InferenceSession": "roseinfer.seed_api",
    "OfflineScheduler": "roseinfer.seed_api",
    "OnlineScheduler": "roseinfer.seed_api",
    "SchedulerManager": "roseinfer.seed_api",
    "OutputDelta": "roseinfer.seed_api",
    "RoseInferError": "roseinfer.errors",
    "InvalidRequestError": "roseinfer.errors",
    "ModelLoadError": "roseinfer.errors",
}
__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "InferenceEngine",
    "InferenceSession",
    "InvalidRequestError",
    "LLM",
    "LLMEngine",
    "ModelLoadError",
    "OfflineScheduler",
    "OnlineScheduler",
    "OutputDelta",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "Request",
    "RequestOutput",
    "RequestOutputKind",
    "RoseInferError",
    "SamplingParams",
    "SchedulerManager",
    "TokenLogprob",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'roseinfer' has no attribute {name!r}")
    if name == "LLM":  # with the seed's view `LLM.engine`, which the seed layer attaches from above
        importlib.import_module("roseinfer.seed_api")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from roseinfer.config import EngineConfig
    from roseinfer.core.request import Request
    from roseinfer.engine.async_llm import AsyncLLM
    from roseinfer.engine.llm import LLM
    from roseinfer.engine.llm_engine import LLMEngine
    from roseinfer.errors import InvalidRequestError, ModelLoadError, RoseInferError
    from roseinfer.outputs import (
        CompletionOutput,
        PoolingOutput,
        PoolingRequestOutput,
        RequestOutput,
        TokenLogprob,
    )
    from roseinfer.pooling_params import PoolingParams
    from roseinfer.sampling_params import RequestOutputKind, SamplingParams
    from roseinfer.seed_api import (
        InferenceEngine,
        InferenceSession,
        OfflineScheduler,
        OnlineScheduler,
        OutputDelta,
        SchedulerManager,
    )
