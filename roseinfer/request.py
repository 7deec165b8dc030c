"""A request's state as the scheduler and the engine see it: token ids, progress, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from roseinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    """One sequence being generated (a request with n > 1 is n of these sharing a group id).

    `num_computed_tokens` counts the tokens whose K/V are in the cache. Each step the scheduler
    gives the request `num_tokens - num_computed_tokens` new tokens (fewer when the budget is
    short, so a long prompt is prefilled in chunks); when the request is caught up, the token
    sampled from its last position is appended.
    """

    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # effective limit: the caller's, capped by the model's context
    prompt: str | None = None
    group_id: int = -1  # the id the caller knows; equals request_id unless n > 1
    index: int = 0  # which of the group's n sequences
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.group_id < 0:
            self.group_id = self.request_id
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at first scheduling
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # -- progress -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()


# The seed's name for a request's state.
InferenceSession = Request
