"""The plain-data messages that cross the engine's seams, as vLLM v1 names them.

    front end --EngineCoreRequest--> EngineCore --SchedulerOutput--> Executor / ModelRunner
    front end <--EngineCoreOutputs-- EngineCore <--ModelRunnerOutput-- Executor / ModelRunner

Every message is a dataclass of ints, strings, lists, `SamplingParams` and numpy arrays only, so
that `roseinfer.common.serial` can send it to another process (an engine-core process, a
tensor-parallel worker) as it is; in one process the objects are passed along without copying.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from roseinfer.outputs import TokenLogprob
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams


@dataclass
class ReasoningSpec:
    """Where a thinking model's output starts, and the tokens that open and close its thinking
    (from the reasoning parser): the engine core follows the thinking token by token, so that a
    grammar constrains only the answer and a thinking budget can close the thinking."""

    start_token_id: int
    end_token_id: int
    phase: str  # roseinfer.reasoning.Phase's value: "undecided" | "thinking" | "answering"


@dataclass
class ImageInput:
    """One image of a prompt: the run of prompt positions it fills and what its encoder reads.

    Within the run, the positions holding `embed_token_id` take the encoder's output rows in
    order; the others are ordinary tokens the processor wrapped the image in (tile separators).
    `digest` (a hash of the image's bytes) keys the prefix cache and the encoder cache: the same
    image reuses both, two different images never share either.
    """

    offset: int
    length: int
    digest: str
    embed_token_id: int
    pixel_values: np.ndarray  # as the model's processor made them, e.g. [tiles, channels, h, w]
    pixel_attention_mask: np.ndarray | None = None


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request with one sequence to generate (n > 1 is fanned out before),
    or, with `pooling_params` instead of `sampling_params`, a prompt to pool into one vector
    (prefill only: it ends after its last prompt token, with no sampled token).

    `sampling_params.max_tokens` is the effective limit (the model's context applied already).
    `fork_of` names a sibling of the same prompt added before this one (n > 1): this request then
    shares that sibling's prompt blocks instead of computing the prompt again. `cache_salt`
    (vLLM's): only requests with the same salt share prefix-cache blocks. `reasoning`: set when
    the engine has a reasoning parser.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_ids: list[int]
    arrival_time: float
    fork_of: str | None = None
    cache_salt: str | None = None
    reasoning: ReasoningSpec | None = None
    pooling_params: PoolingParams | None = None
    images: list[ImageInput] = field(default_factory=list)  # in prompt order

    def __post_init__(self) -> None:
        if (self.sampling_params is None) == (self.pooling_params is None):
            raise ValueError(f"request {self.request_id!r} needs sampling_params or pooling_params (one of them)")


@dataclass
class EngineCoreOutput:
    """What one step produced for one request: new tokens and, on its last output, why it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None  # with finish_reason "error": what went wrong
    error_param: str | None = None  # the request field at fault (a 400 naming it), if the request's own
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at first scheduling
    first_scheduled_time: float | None = None  # time.monotonic() when it first ran
    grammar_compile_time: float | None = None  # structured outputs: seconds its grammar took
    # A pooling request's last output: the pooled final-norm hidden state (float32, not yet
    # truncated or normalized: the output processor does that, by its PoolingParams).
    pooled: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler and KV cache, sent with every batch of outputs."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests, 0..1
    num_preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # prompt tokens looked up, since start
    prefix_cache_hits: int = 0  # of those, tokens found
    max_batch_requests: int = 0  # the most requests one step has run together
    num_steps: int = 0
    num_scheduled_tokens: int = 0  # tokens run through the model, since start
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, since start
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None


@dataclass
class NewRequestData:
    """A request the model runner has not seen: everything it needs to run it."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before (a fork's parent has none yet)
    sampling_params: SamplingParams | None  # None for a pooling request
    eos_token_ids: list[int]
    # Its block table: one list per KV cache group (common/kv_cache_spec.py), a recurrent group's
    # holding the request's state slot.
    block_ids: list[list[int]]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request: pool its prompt, sample nothing
    images: list[ImageInput] = field(default_factory=list)  # its prompt's images, in order


@dataclass
class CachedRequestData:
    """A request the runner knows: what changed since it last ran."""

    req_id: str
    new_token_ids: list[int]  # tokens the scheduler appended since the runner last saw it
    block_ids: list[list[int]] | None  # the whole block tables (one per group) when changed, else None
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """One step's batch, in the order the runner lays it out."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # (src, dst) before the step; (src, dst, group) for a KV cache group other than the first.
    blocks_to_copy: list[tuple[int, ...]] = field(default_factory=list)
    # (state slot, snapshot slot) of the recurrent group after the step's forward: the prefix
    # cache's state snapshots (core/kv_cache/recurrent_state.py).
    states_to_save: list[tuple[int, int]] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # the runner forgets these
    # Structured outputs: the allowed next tokens of the constrained requests that sample this
    # step, one int32 row of bits each (bit t set: token t allowed), and request id -> row.
    grammar_bitmask: np.ndarray | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: draft tokens to verify after a request's last token (counted in
    # num_scheduled_tokens); the runner returns the accepted ones and one more.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of the requests that got a sample this step (caught-up ones), in order; and
    the pooled hidden states (final-norm output, float32, one vector each) of the pooling requests
    whose last prompt token ran this step."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None  # per request, one per sampled token
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
