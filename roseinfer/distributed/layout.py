"""Where the ranks of a tensor-parallel engine run and how they find each other.

Host 0 runs the engine (scheduler, server) and the workers of its ranks; each other host runs only
the workers of its ranks (`--node-rank N`, or a process launched by `torchrun`). Every worker joins
the torch.distributed group at `--master-addr:--master-port` (torchrun's own store when torchrun
launched it) and takes the engine's messages over ZeroMQ: IPC sockets on one host, TCP on host 0's
next two ports when the ranks span hosts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from roseinfer.errors import InvalidRequestError

if TYPE_CHECKING:
    from roseinfer.config import EngineConfig

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistributedLayout:
    world_size: int
    local_ranks: list[int]  # the global ranks whose workers this process starts
    local_world: int  # ranks on this host (they share its cores)
    first_local_index: int  # this process's first rank's index among the host's ranks
    master_addr: str
    master_port: int | None
    multi_host: bool  # messages over TCP (ranks in other processes that this one did not start)
    torchrun: bool
    runs_engine: bool

    @property
    def backend_init_method(self) -> str:
        """torch.distributed's rendezvous: torchrun's store (env://), or a TCP store on rank 0."""
        if self.torchrun:
            return "env://"
        return f"tcp://{_url_host(self.master_addr)}:{self.master_port}"

    def tcp_message_addresses(self) -> tuple[str, str]:
        """The engine's broadcast and reply sockets on host 0 when ranks span hosts."""
        host = _url_host(self.master_addr)
        return f"tcp://{host}:{self.master_port + 1}", f"tcp://{host}:{self.master_port + 2}"

    def with_free_port(self) -> DistributedLayout:
        """One host and no port given: any free one for the rendezvous."""
        if self.master_port is not None:
            return self
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return DistributedLayout(**{**self.__dict__, "master_port": port})


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def distributed_layout(config: EngineConfig) -> DistributedLayout:
    size = config.tensor_parallel_size
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise InvalidRequestError(
                f"torchrun started {world} processes but tensor_parallel_size is {size}: "
                f"pass --tensor-parallel-size {world}", "tensor_parallel_size",
            )
        rank = int(os.environ["RANK"])
        return DistributedLayout(
            world_size=world, local_ranks=[rank], local_world=int(os.environ["LOCAL_WORLD_SIZE"]),
            first_local_index=int(os.environ["LOCAL_RANK"]), master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]), multi_host=True, torchrun=True, runs_engine=rank == 0,
        )
    per_host = size // config.nnodes
    first = config.node_rank * per_host
    return DistributedLayout(
        world_size=size, local_ranks=list(range(first, first + per_host)), local_world=per_host,
        first_local_index=0, master_addr=config.master_addr, master_port=config.master_port,
        multi_host=config.nnodes > 1, torchrun=False, runs_engine=config.node_rank == 0,
    )


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
