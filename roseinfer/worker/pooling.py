"""Pooling requests (embeddings): their rows of the final-norm hidden states become one vector, the
last prompt token's row or the mean over every chunk's rows, summed as the chunks come."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.worker.request_state import CachedRequestState


@dataclass
class PoolingRows:
    state: CachedRequestState
    first_row: int  # of this step's hidden states
    num_rows: int
    first_position: int  # of the request's prompt
    last_chunk: bool  # the prompt's last token is among them: the vector is complete


def pool_hidden_states(hidden: torch.Tensor, entries: list[PoolingRows]) -> dict[str, np.ndarray]:
    """The pooled vectors (float32) of the pooling requests whose prompt ends this step; mean
    pooling adds up each chunk's rows as they come."""
    pooled: dict[str, np.ndarray] = {}
    for entry in entries:
        state = entry.state
        rows = hidden[entry.first_row : entry.first_row + entry.num_rows]
        if state.pooling_params.pooling_type == "mean":
            if entry.first_position == 0:  # (again) from the start: a preempted request is recomputed
                state.pool_sum, state.pool_count = None, 0
            elif entry.first_position == state.pool_before_last[1]:  # a replayed step runs its chunk again
                state.pool_sum, state.pool_count = state.pool_before_last
            if entry.first_position != state.pool_count:
                raise RuntimeError(f"mean pooling of request {state.req_id!r}: a chunk starts at "
                                   f"{entry.first_position}, but {state.pool_count} rows were summed")
            state.pool_before_last = (state.pool_sum, state.pool_count)
            chunk = rows.float().sum(dim=0)
            state.pool_sum = chunk if state.pool_sum is None else state.pool_sum + chunk
            state.pool_count += entry.num_rows
            if entry.last_chunk:
                pooled[state.req_id] = (state.pool_sum / state.pool_count).cpu().numpy()
        elif entry.last_chunk:  # last
            pooled[state.req_id] = rows[-1].float().cpu().numpy()
    return pooled
