"""What callers get back, shaped like vLLM's: a `RequestOutput` per request, holding a
`CompletionOutput` per generated sequence (whole, or only what is new, by `RequestOutputKind`);
for a pooling request (an embedding), one `PoolingRequestOutput` holding a `PoolingOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and, optionally, the top alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # with finish_reason "error": what went wrong

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request (time.monotonic seconds) and what the cache saved it."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first scheduling
    grammar_compile_time: float | None = None  # structured outputs: seconds its grammar took


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # DELTA: only the sequences this step changed
    finished: bool = True
    metrics: RequestMetrics | None = None


@dataclass
class PoolingOutput:
    """One vector of a prompt: float32, truncated to `dimensions` and normalized as asked."""

    data: np.ndarray

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output (vLLM's name). `outputs` is None when it did not finish
    normally: `finish_reason` "abort" or "error" (with `error` saying why)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    finish_reason: str | None = "stop"
    error: str | None = None
    metrics: RequestMetrics | None = None
