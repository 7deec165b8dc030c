"""The executor interface the engine core talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from roseinfer.common.messages import ModelRunnerOutput, SchedulerOutput
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.step_timings import StepTimings


class Executor(ABC):
    """Loads the model (on every worker it has), allocates the KV pool and runs steps."""

    @abstractmethod
    def __init__(self, config: EngineConfig, model_config: ModelConfig, timings: StepTimings) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; raises if the step failed (the core then fails its requests)."""

    def register_failure_callback(self, callback: Callable[[str], None]) -> None:  # noqa: B027
        """Have `callback(reason)` called once if the executor fails between steps (a worker
        process dies while the engine is idle). An in-process executor cannot fail that way."""

    def shutdown(self) -> None:  # noqa: B027 - optional: an in-process executor has nothing to release
        """Release workers and memory."""
