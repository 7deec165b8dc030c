"""A tensor-parallel worker process: one rank's model shard, KV pool and model runner, driven by
the messages its executor broadcasts (common/channel.py).

    ("init", (EngineConfig, ModelConfig))  join the torch.distributed group, load this rank's
                                           shard, build the runner; reply ("ready", rank, None)
    ("step", SchedulerOutput)              run it; rank 0 replies ("output", 0, ModelRunnerOutput)
    ("rpc", (method, args))                every rank replies ("rpc", rank, result)
    ("shutdown", None)                     leave

Every rank keeps its own per-request state from the same messages, so the ranks stay in step
without talking to each other outside the model's collectives. An exception is reported as
("error", rank, message) and ends the process: the ranks' collectives are out of step after a
failed step, so none of them can go on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.common.channel import EngineGoneError, WorkerChannels
from roseinfer.common.channel_security import channel_keys
from roseinfer.common.messages import ModelRunnerOutput, SchedulerOutput
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.distributed.cpu_binding import apply_cpu_binding
from roseinfer.distributed.network import choose_gloo_interface
from roseinfer.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from roseinfer.models.loader import load_model_weights
from roseinfer.worker.model_runner import ModelRunner

logger = logging.getLogger("roseinfer")

# What the executor may call on every rank with ("rpc", (method, args)).
RPC_METHODS = ("compute_logits", "cache_state")


@dataclass
class WorkerSpec:
    """Everything a worker process needs before its first message."""

    rank: int
    world_size: int
    local_index: int  # among this host's ranks: its CUDA device
    local_world: int  # ranks on this host
    cores: list[int] | None  # None: not pinned
    broadcast_address: str
    reply_address: str
    init_method: str  # torch.distributed's rendezvous
    master_addr: str | None = None  # host 0, when the ranks span hosts
    one_host: bool = True  # every rank runs on this host (shared-memory all-reduce on the CPU)
    log_level: int = logging.INFO

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


class Worker:
    def __init__(self, spec: WorkerSpec, config: EngineConfig, model_config: ModelConfig) -> None:
        self.rank = spec.rank
        if config.torch_device.type == "cuda":
            torch.cuda.set_device(spec.local_index)
            config.device = f"cuda:{spec.local_index}"
        backend = "nccl" if config.torch_device.type == "cuda" else "gloo"
        if backend == "gloo" and spec.master_addr is not None:
            choose_gloo_interface(spec.master_addr)
        shared_bytes = None
        if backend == "gloo" and spec.one_host and config.cpu_allreduce == "shm":
            # The largest all-reduce: a step's tokens times the hidden size.
            element = torch.tensor([], dtype=config.torch_dtype).element_size()
            shared_bytes = config.max_num_batched_tokens * model_config.hidden_size * element
        init_tensor_parallel(spec.rank, spec.world_size, backend, spec.init_method,
                             shared_memory_bytes=shared_bytes)
        torch.manual_seed(config.seed)  # as the in-process executor does; only rank 0 samples
        self.runner = ModelRunner(load_model_weights(config, model_config), model_config, config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    # -- RPCs (tests and tools) ------------------------------------------------------------
    def compute_logits(self, scheduler_output: SchedulerOutput) -> tuple[np.ndarray, list[str]] | None:
        """The step's raw logits (float32) on rank 0; None on the others."""
        logits, req_ids = self.runner.compute_logits(scheduler_output)
        return None if logits is None else (logits.float().cpu().numpy(), req_ids)

    def cache_state(self) -> dict[str, int]:
        """What this rank holds: the requests its runner knows, its pool's blocks and KV heads."""
        runner = self.runner
        pool = next(cache for cache, group in zip(runner.kv_caches, runner.layer_groups, strict=True)
                    if group in runner.paged_groups)  # a KV pool (not a recurrent layer's state)
        blocks = sum(runner.group_num_blocks[group] for group in runner.paged_groups)
        return {"requests": len(runner.requests), "num_blocks": blocks, "kv_heads": pool.shape[3]}


def run_worker(spec: WorkerSpec) -> None:
    """The worker process's main function."""
    logging.basicConfig(level=spec.log_level, format=f"%(levelname)s %(asctime)s %(name)s[tp{spec.rank}]: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine stops us
    threads = apply_cpu_binding(spec.cores, spec.local_world)
    logger.debug("rank %d: pid %d, cores %s, %d threads", spec.rank, os.getpid(), spec.cores, threads)
    keys = channel_keys() if spec.broadcast_address.startswith("tcp://") else None  # other hosts: CURVE
    channels = WorkerChannels(spec.broadcast_address, spec.reply_address, parent_pid=os.getppid(), keys=keys)
    worker: Worker | None = None
    try:
        while True:
            kind, payload = channels.recv()
            if kind == "step":
                output = worker.execute_model(payload)
                if spec.rank == 0:
                    channels.send(("output", 0, output))
            elif kind == "init":
                worker = Worker(spec, *payload)
                channels.send(("ready", spec.rank, None))
            elif kind == "rpc":
                method, args = payload
                if method not in RPC_METHODS:
                    raise ValueError(f"unknown worker method {method!r}")
                channels.send(("rpc", spec.rank, getattr(worker, method)(*args)))
            elif kind == "shutdown":
                return
            else:
                raise ValueError(f"unknown message {kind!r}")
    except EngineGoneError as exc:
        logger.warning("rank %d stops: %s", spec.rank, exc)
    except BaseException as exc:
        logger.exception("rank %d failed", spec.rank)
        try:
            channels.send(("error", spec.rank, f"{type(exc).__name__}: {exc}"))
        except EngineGoneError:
            pass
        raise SystemExit(1) from exc
    finally:
        destroy_tensor_parallel()
        channels.close()
