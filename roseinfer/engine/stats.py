"""The figures one batch of outputs adds to the metrics: token counts, latencies, finished requests.

The output processor fills an `IterationStats` per batch; stat loggers (Prometheus in the server,
the periodic log line) consume them together with the engine core's `SchedulerStats` snapshot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from roseinfer.common.messages import SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reasons: list[str]  # one per sequence
    e2e_latency: float  # arrival to the last token, seconds
    queue_time: float | None  # arrival to first scheduling
    num_prompt_tokens: int
    num_generation_tokens: int
    structured_output_kind: str | None = None  # "json", "regex", "choice", "grammar", "json_object"


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0  # of requests that got their first token in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """What LLMEngine and AsyncLLM feed after every batch of outputs."""

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None: ...


class LoggingStatLogger:
    """The periodic log line: throughput since the last line, queue, KV cache and prefix cache."""

    def __init__(self, interval: float = 10.0, log: logging.Logger | None = None) -> None:
        self.interval = interval
        self.log = log or logging.getLogger("roseinfer")
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        self._generation_tokens += iteration_stats.num_generation_tokens
        self._prompt_tokens += iteration_stats.num_prompt_tokens
        now = time.monotonic()
        if scheduler_stats is None or now - self._last < self.interval:
            return
        elapsed, self._last = now - self._last, now
        queries = scheduler_stats.prefix_cache_queries
        hit_rate = scheduler_stats.prefix_cache_hits / queries if queries else 0.0
        self.log.info(
            "throughput: prompt %.1f tok/s, generation %.1f tok/s; running %d, waiting %d; "
            "KV cache usage %.1f%%; prefix cache hit rate %.1f%%",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, scheduler_stats.num_running,
            scheduler_stats.num_waiting, 100 * scheduler_stats.kv_cache_usage, 100 * hit_rate,
        )
        self._prompt_tokens = self._generation_tokens = 0
