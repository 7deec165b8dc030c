"""This process's place in the tensor-parallel group, and the collectives the model code uses.

A process that never joins a group is rank 0 of 1 and every collective is the identity, so the
same model code runs with and without tensor parallelism.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from roseinfer.distributed.shm_allreduce import SharedMemoryAllReduce, shm_allreduce_supported

logger = logging.getLogger("roseinfer")


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    shared_memory: SharedMemoryAllReduce | None = None  # CPU ranks on one host


    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum the partial results of a row-parallel layer across ranks (in place)."""
        if self.size == 1:
            return tensor
        if self.shared_memory is not None and self.shared_memory.fits(tensor):
            return self.shared_memory(tensor)
        dist.all_reduce(tensor)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's slice of the last dimension on rank 0 (the vocabulary-parallel
        logits); other ranks get None, as they do not sample."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.rank != 0:
            dist.gather(tensor, None, dst=0)
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1)


_group = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _group


def init_tensor_parallel(
    rank: int, size: int, backend: str, init_method: str, timeout_s: float = 600.0,
    shared_memory_bytes: int | None = None,
) -> TensorParallelGroup:
    """Join the group (every rank calls this; it returns once all have) and make it the one the
    model code sees. `shared_memory_bytes`: all ranks are CPU processes of one host, and
    all-reduces up to this size go through shared memory rather than gloo."""
    global _group
    if size > 1 or backend == "nccl":
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    shared = None
    if shared_memory_bytes and size > 1 and backend == "gloo":
        if shm_allreduce_supported():
            shared = SharedMemoryAllReduce(rank, size, shared_memory_bytes)
        else:
            logger.warning("shared-memory all-reduce needs x86-64 and /dev/shm: gloo does them all")
    _group = TensorParallelGroup(rank, size, shared)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()
