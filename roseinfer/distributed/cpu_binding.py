"""Which CPU cores each rank of this host runs on (vLLM's thread binding, in spirit).

Ranks that share cores fight over them: each rank's OpenMP threads spin while they wait for the
others, so on a CPU every rank gets cores of its own. `--cpu-threads-bind`:

    auto      split the cores this process may use (its affinity) into one contiguous run per
              local rank, as evenly as they go (the default)
    none      leave placement to the OS; each rank still uses cores / ranks threads
    0-3|4-7   one list per local rank, in `taskset -c` syntax ("0,2,4-7"), separated by "|"
"""

from __future__ import annotations

import logging
import os

from roseinfer.config import parse_cpu_binding
from roseinfer.errors import InvalidRequestError

logger = logging.getLogger("roseinfer")


def plan_cpu_binding(spec: str, local_ranks: int) -> list[list[int] | None]:
    """The cores of each local rank (None: not bound) and, implicitly, its thread count."""
    explicit = parse_cpu_binding(spec)
    if explicit is not None:
        if len(explicit) != local_ranks:
            raise InvalidRequestError(
                f"cpu_threads_bind gives {len(explicit)} core list(s) for {local_ranks} rank(s) on this host",
                "cpu_threads_bind",
            )
        return list(explicit)
    if spec == "none":
        return [None] * local_ranks
    available = sorted(os.sched_getaffinity(0))
    if len(available) < local_ranks:
        logger.warning("%d ranks share %d core(s): each rank gets one, some the same", local_ranks, len(available))
        return [[available[rank % len(available)]] for rank in range(local_ranks)]
    per_rank, extra = divmod(len(available), local_ranks)
    plan, start = [], 0
    for rank in range(local_ranks):
        size = per_rank + (1 if rank < extra else 0)
        plan.append(available[start : start + size])
        start += size
    return plan


def apply_cpu_binding(cores: list[int] | None, local_ranks: int) -> int:
    """Pin this process to `cores` and size PyTorch's thread pool to match; returns the threads."""
    import torch

    if cores is not None:
        os.sched_setaffinity(0, cores)
        threads = len(cores)
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // local_ranks)
    torch.set_num_threads(threads)
    return threads
