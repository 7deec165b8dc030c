"""Per-request pooling parameters (vLLM's `PoolingParams`): a request that asks for one vector of
its prompt instead of generated tokens. The engine runs its prompt (prefill only), pools the
final-norm hidden states, and the output processor finishes the vector here (`finish_embedding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from roseinfer.errors import InvalidRequestError

# last: the hidden state of the prompt's last token (decoder embedding models: Qwen3-Embedding,
# e5-mistral); mean: the average over every prompt token.
POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    """How to make one vector of a prompt.

    `pooling_type` and `normalize` left None take the engine's defaults (`--pooling`,
    `--no-normalize`). `dimensions`: keep only the first this many values (Matryoshka
    embeddings), then normalize them.
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}", "pooling_type"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", "normalize")
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise InvalidRequestError(f"dimensions must be a whole number >= 1, got {dims!r}", "dimensions")

    @property
    def n(self) -> int:
        """One vector per prompt: what the queue limit counts (as SamplingParams.n)."""
        return 1


def finish_embedding(pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
    """The pooled hidden state as the caller asked for it: truncated to `dimensions`, then
    scaled to unit length if `normalize` (float32 throughout, as the engine pooled it)."""
    vector = np.asarray(pooled, dtype=np.float32)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        vector = vector / np.float32(max(norm, 1e-12))  # as torch.nn.functional.normalize's eps
    return vector.astype(np.float32, copy=False)
