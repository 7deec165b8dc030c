"""Where each engine step's time goes, accumulated since the engine started.

Always on: ten `perf_counter` calls a step cost about a microsecond. `roseinfer bench offline
--profile` prints the breakdown; the part outside `forward` is the engine's own overhead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields


@dataclass
class StepTimings:
    steps: int = 0
    schedule: float = 0.0  # choosing requests and blocks
    prepare: float = 0.0  # building the flattened batch's tensors
    forward: float = 0.0  # the model, logits included
    sample: float = 0.0  # sampling and copying the tokens out
    update: float = 0.0  # the scheduler's update: appending tokens, stop checks, freeing
    output: float = 0.0  # the front end's output processing: detokenizing, stop strings, outputs

    PHASES = ("schedule", "prepare", "forward", "sample", "update", "output")

    @property
    def total(self) -> float:
        return sum(getattr(self, phase) for phase in self.PHASES)

    @property
    def overhead_fraction(self) -> float:
        """Share of step time spent outside the model's forward pass."""
        return 1.0 - self.forward / self.total if self.total else 0.0

    def snapshot(self) -> StepTimings:
        return StepTimings(**{f.name: getattr(self, f.name) for f in fields(self)})

    def since(self, earlier: StepTimings) -> StepTimings:
        return StepTimings(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})


class PhaseClock:
    """`clock.lap("prepare")` adds the time since the previous lap to that phase."""

    def __init__(self, timings: StepTimings) -> None:
        self.timings = timings
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.timings, phase, getattr(self.timings, phase) + now - self.last)
        self.last = now
