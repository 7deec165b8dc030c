"""All-reduce through shared memory, for tensor-parallel ranks on one CPU host.

gloo moves every all-reduce through the kernel's TCP stack: on this 2-core machine each one costs
0.5-2 ms whatever its size, and a decoder layer has two. Ranks on one host can instead meet in a
shared segment: each rank copies its partial result into its own slot, raises its flag (a
sequence number), waits for every other flag, and adds the slots up in rank order, so every rank
computes bit for bit the same sum. Two sets of slots alternate, so a rank may start the next
all-reduce while a slower one is still reading the last: no rank can write step k + 2 before all
have finished step k (each rank's flag for k + 1 comes after its sum for k).

No library does this for PyTorch on the CPU (oneCCL's bindings are built against specific PyTorch
releases and Intel's own index; vLLM and SGLang carry their own kernels), so it is this small
module. It relies on x86's store ordering (a flag written after the data is never seen before
it), so it is used on x86-64 only; the gloo group stays for everything else (the rendezvous, the
logits gather, tensors larger than a slot).
"""

from __future__ import annotations

import mmap
import os
import platform
import uuid

import numpy as np
import torch
import torch.distributed as dist

_FLAG_STRIDE = 8  # int64s between two ranks' flags: one cache line each
_SPINS_BEFORE_YIELD = 2000


def shm_allreduce_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class SharedMemoryAllReduce:
    def __init__(self, rank: int, size: int, capacity_bytes: int) -> None:
        """Every rank of the (already initialised) process group calls this together."""
        capacity_bytes = -(-capacity_bytes // 64) * 64  # every slot starts on a cache line
        self.rank, self.size, self.capacity = rank, size, capacity_bytes
        header = size * _FLAG_STRIDE * 8
        total = header + 2 * size * capacity_bytes
        name = [f"/dev/shm/roseinfer-allreduce-{uuid.uuid4().hex}" if rank == 0 else None]
        if rank == 0:
            fd = os.open(name[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
        dist.broadcast_object_list(name, src=0)
        if rank != 0:
            fd = os.open(name[0], os.O_RDWR)
        self._map = mmap.mmap(fd, total)
        os.close(fd)
        dist.barrier()  # everyone has it mapped: the name can go (the memory stays while mapped)
        if rank == 0:
            os.unlink(name[0])
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=size * _FLAG_STRIDE)[::_FLAG_STRIDE]
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=header,
                                       count=2 * size * capacity_bytes).view(2, size, capacity_bytes)
        self._step = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.capacity

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        nbytes = tensor.numel() * tensor.element_size()
        self._step += 1
        slots = self._slots[self._step % 2]
        slots[self.rank, :nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        self._flags[self.rank] = self._step
        spins = 0
        while (self._flags < self._step).any():
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:  # the machine is oversubscribed: let the others run
                os.sched_yield()
        parts = [slots[rank, :nbytes].view(tensor.dtype).view(tensor.shape) for rank in range(self.size)]
        torch.add(parts[0], parts[1], out=tensor)
        for part in parts[2:]:
            tensor.add_(part)
        return tensor
