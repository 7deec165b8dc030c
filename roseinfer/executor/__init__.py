"""Executors run the model for the engine core: `execute_model(SchedulerOutput) -> ModelRunnerOutput`.

The in-process executor drives one model runner in the engine core's own thread; the
multiprocess executor drives one worker process per tensor-parallel rank (executor/multiproc.py)
behind the same interface.
"""

from __future__ import annotations

from roseinfer.config import EngineConfig
from roseinfer.executor.base import Executor
from roseinfer.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "executor_class"]


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor the configuration asks for."""
    if config.executor_backend == "mp":
        from roseinfer.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    return UniProcExecutor
