"""A request's state inside the engine core: its token ids, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from roseinfer.common.messages import EngineCoreRequest, ImageInput, ReasoningSpec
from roseinfer.core.reasoning_tracker import ReasoningTracker
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from roseinfer.structured_output import Grammar


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


class Request:
    """One sequence being generated, as the scheduler sees it.

    `num_computed_tokens` counts the tokens whose K/V are in the cache. Each step the scheduler
    gives the request `num_tokens - num_computed_tokens` new tokens (fewer when the budget is short,
    so a long prompt is prefilled in chunks); when it is caught up, the token sampled from its last
    position is appended. `num_synced_tokens` and `synced_block_ids` record what the model runner
    has been told, so each step sends it only what changed.

    A pooling request (`pooling_params`, no `sampling_params`) generates nothing: it ends once its
    whole prompt is computed, with the pooled hidden state the runner returns for it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        max_tokens: int | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        fork_of: str | None = None,
        cache_salt: str | None = None,
        reasoning: ReasoningSpec | None = None,
        pooling_params: PoolingParams | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        if (sampling_params is None) == (pooling_params is None):
            raise ValueError(f"request {request_id!r} needs sampling_params or pooling_params (one of them)")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        # The effective limit: the caller's, capped by the model's context (by the input processor).
        # A pooling request generates nothing.
        if pooling_params is not None:
            max_tokens = 0
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        if self.max_tokens is None:
            raise ValueError(f"request {request_id!r} has no max_tokens")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.fork_of = fork_of
        self.cache_salt = cache_salt  # the prefix cache shares blocks only within one salt
        # Set by the engine core where the model computes this request's keys differently from
        # another's with the same tokens (LongRoPE past the original context): its own prefix cache.
        self.kv_variant: str | None = None
        # A vision-language prompt's images. The image placeholders are the same token ids whatever
        # the image, so the prompt's blocks are keyed by its images' digests as well: the same
        # conversation with the same images shares them, different images never do.
        self.images = images or []
        if self.images:
            self.kv_variant = "images:" + ",".join(image.digest for image in self.images)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at first scheduling
        self.first_scheduled_time: float | None = None
        self.num_synced_tokens = 0  # token_ids[:n] are known to the runner
        self.synced_block_ids: list[list[int]] | None = None  # None: the runner does not know it
        # Structured outputs (core/structured_output_manager.py): the grammar while it compiles,
        # then this request's place in it, or why it could not compile.
        self.grammar_future: Future | None = None
        self.grammar: Grammar | None = None
        self.grammar_error: str | None = None
        self.grammar_error_param: str | None = None  # the request field the error is about
        self.grammar_compile_time: float | None = None
        # A thinking model's request (a reasoning parser is on): where it is in its thinking.
        self.reasoning = (ReasoningTracker(reasoning, sampling_params.thinking_token_budget)
                          if reasoning and sampling_params is not None else None)
        # Speculative decoding (core/spec_decode.py): recent drafts and how many were accepted.
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.spec_cooldown = 0

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_ids=request.eos_token_ids, arrival_time=request.arrival_time, fork_of=request.fork_of,
            cache_salt=request.cache_salt, reasoning=request.reasoning, pooling_params=request.pooling_params,
            images=request.images,
        )

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

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

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, {self.num_computed_tokens}/{self.num_tokens})"
