"""Executors run the model for the engine core: `execute_model(SchedulerOutput) -> ModelRunnerOutput`.

The in-process executor drives one model runner in the engine core's own thread; an executor of
several worker processes (tensor parallelism) implements the same interface.
"""

from __future__ import annotations

from roseinfer.config import EngineConfig
from roseinfer.executor.base import Executor
from roseinfer.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "executor_class"]


def executor_class(config: EngineConfig) -> type[Executor]:
    """The executor the configuration asks for."""
    return UniProcExecutor
