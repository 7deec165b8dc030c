"""The worker processes of one host: one spawned process per local rank, each pinned to its cores;
and a host that runs only workers (`--node-rank N`, or a non-zero rank under torchrun)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from roseinfer.config import EngineConfig
from roseinfer.distributed.cpu_binding import plan_cpu_binding
from roseinfer.distributed.layout import DistributedLayout, distributed_layout
from roseinfer.worker.worker import WorkerSpec

logger = logging.getLogger("roseinfer")

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding this roseinfer package


class LocalWorkers:
    """One `python -m roseinfer.worker` process per local rank. A pidfd per process (readable once
    it exits) lets the executor wait on workers and ZeroMQ sockets in one poll."""

    def __init__(self, config: EngineConfig, layout: DistributedLayout, broadcast_address: str,
                 reply_address: str) -> None:
        cores = plan_cpu_binding(config.cpu_threads_bind, layout.local_world)
        environment = os.environ | {
            # The workers import this very roseinfer, wherever it was imported from.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.ranks = list(layout.local_ranks)
        self.processes: list[subprocess.Popen] = []
        self.pidfds: list[int] = []
        for offset, rank in enumerate(layout.local_ranks):
            index = layout.first_local_index + offset
            spec = WorkerSpec(
                rank=rank, world_size=layout.world_size, local_index=index, local_world=layout.local_world,
                cores=cores[index], broadcast_address=broadcast_address, reply_address=reply_address,
                init_method=layout.backend_init_method, log_level=logging.getLogger().getEffectiveLevel(),
                master_addr=layout.master_addr if layout.multi_host else None,
                one_host=layout.local_world == layout.world_size,
            )
            process = subprocess.Popen([sys.executable, "-m", "roseinfer.worker", spec.to_json()], env=environment)
            self.processes.append(process)
            self.pidfds.append(os.pidfd_open(process.pid))
        atexit.register(self.kill)  # an engine that was never shut down leaves no worker behind
        logger.info("started tensor-parallel rank(s) %s: pids %s, cores %s", self.ranks,
                    [p.pid for p in self.processes], [cores[layout.first_local_index + i] for i in range(len(self.ranks))])

    @property
    def sentinels(self) -> list[int]:
        return list(self.pidfds)

    def first_dead(self) -> tuple[int, int | None] | None:
        """(rank, exit code) of a worker that has exited, if any."""
        for rank, process in zip(self.ranks, self.processes, strict=True):
            if process.poll() is not None:
                return rank, process.returncode
        return None

    def wait_any(self) -> tuple[int, int | None]:
        """Block until a worker exits; its (rank, exit code)."""
        multiprocessing.connection.wait(self.pidfds)
        dead = self.first_dead()
        while dead is None:  # the pidfd fires as the process exits; reaping may lag a moment
            time.sleep(0.01)
            dead = self.first_dead()
        return dead

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the workers to leave (after a shutdown message); terminate, then kill, the rest."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._close_pidfds()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        self._close_pidfds()

    def _close_pidfds(self) -> None:
        atexit.unregister(self.kill)
        for fd in self.pidfds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.pidfds = []


def run_worker_host(config: EngineConfig) -> int:
    """A host without the engine: start its ranks' workers, which take their configuration and
    every step from host 0, and wait until they leave (host 0 shut down) or SIGTERM/SIGINT."""
    layout = distributed_layout(config)
    broadcast, reply = layout.tcp_message_addresses()
    workers = LocalWorkers(config, layout, broadcast, reply)
    stopping = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        for process in workers.processes:
            if process.poll() is None:
                process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logger.info("worker host: rank(s) %s of %d, waiting for the engine at %s", layout.local_ranks,
                layout.world_size, broadcast)
    failed = 0
    for rank, process in zip(workers.ranks, workers.processes, strict=True):
        process.wait()
        if process.returncode and not stopping:
            logger.error("rank %d exited with code %s", rank, process.returncode)
            failed = 1
    workers.stop(timeout=0)
    return failed


def run_worker_host_if_asked(config: EngineConfig) -> int | None:
    """On a host other than host 0 (`--node-rank N`, or a non-zero rank under torchrun): run this
    host's workers until host 0's engine stops, and return the exit code; None on host 0."""
    if distributed_layout(config).runs_engine:
        return None
    return run_worker_host(config)
