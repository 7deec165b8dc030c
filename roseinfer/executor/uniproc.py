"""The in-process executor: one model runner, called in the engine core's thread."""

from __future__ import annotations

import torch

from roseinfer.common.messages import ModelRunnerOutput, SchedulerOutput
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.executor.base import Executor
from roseinfer.models.loader import load_model_weights
from roseinfer.step_timings import StepTimings
from roseinfer.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig, timings: StepTimings) -> None:
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible from one start to the next
        model = load_model_weights(config, model_config)
        self.model_runner = ModelRunner(model, model_config, config, timings)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
