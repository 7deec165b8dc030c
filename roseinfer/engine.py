"""The engine: requests in, one scheduled step at a time, output deltas out.

    add_request -> Scheduler (waiting) -> step(): schedule, ModelRunner.execute, then for every
    sampled token: append, stop checks, detokenize -> OutputDelta per sequence.

A request with n > 1 becomes n sequences in one group; the group's id is the id the caller sees.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from roseinfer.config import EngineConfig
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.core.scheduler import Scheduler
from roseinfer.errors import InvalidRequestError
from roseinfer.models.loader import load_model
from roseinfer.output_processor import SequenceText
from roseinfer.outputs import (
    CompletionOutput,
    OutputDelta,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from roseinfer.request import Request, RequestStatus
from roseinfer.sampling_params import SamplingParams
from roseinfer.step_timings import PhaseClock, StepTimings
from roseinfer.worker.model_runner import ModelRunner, kv_block_bytes

logger = logging.getLogger("roseinfer")

GIB = 1024**3


@dataclass
class RequestGroup:
    group_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[Request]
    texts: list[SequenceText]

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    def to_output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=text.text,
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                cumulative_logprob=text.cumulative_logprob if text.logprobs is not None else None,
                logprobs=text.logprobs,
            )
            for seq, text in zip(self.sequences, self.texts, strict=True)
        ]
        first = self.sequences[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((s.first_token_time for s in self.sequences if s.first_token_time), default=None),
            finished_time=max((s.finished_time for s in self.sequences if s.finished_time), default=None),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(self.group_id, self.prompt, self.prompt_token_ids, outputs, self.finished, metrics)


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: int = 0


class InferenceEngine:
    """Model + tokenizer + paged KV cache + scheduler.

    `InferenceEngine(model=None, **engine_args)`; the seed's spelling
    `InferenceEngine(checkpoint_path=..., tokenizer_name=..., device=...)` works too.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        checkpoint_path: str | None = None,
        tokenizer_name: str | None = None,
        **engine_args,
    ) -> None:
        if config is None:
            if checkpoint_path is not None:
                model = checkpoint_path
            if tokenizer_name is not None:
                engine_args["tokenizer"] = tokenizer_name
            config = EngineConfig.from_kwargs(model=model, **engine_args)
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype

        started = time.perf_counter()
        loaded = load_model(config.model, config.tokenizer, self.device, self.dtype, config.quantization)
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or loaded.name
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.eos_token_id = self.tokenizer.eos_token_id

        num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_model_len = self._max_model_len(num_blocks)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model, self.model_config, self.kv_cache, self.device, self.dtype, config.attention_backend
        )
        torch.manual_seed(config.seed)
        self._ids = itertools.count()
        self._groups: dict[int, RequestGroup] = {}
        self._sequences: dict[int, tuple[RequestGroup, int]] = {}
        self.stats = EngineStats()
        self.timings = StepTimings()
        logger.info(
            "loaded %s (%s, %d layers) on %s/%s, quantization %s, in %.1fs; KV cache: %d blocks of %d tokens "
            "(%.2f GiB), max_model_len %d",
            self.model_name, self.model_config.architecture, self.model_config.num_layers,
            self.device, str(self.dtype).removeprefix("torch."), config.quantization,
            time.perf_counter() - started,
            num_blocks, config.block_size,
            num_blocks * kv_block_bytes(self.model_config, config.block_size, self.dtype) / GIB,
            self.max_model_len,
        )

    # -- set-up ---------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        gib = self.config.kv_cache_memory or EngineConfig.DEFAULT_KV_CACHE_GIB
        per_block = kv_block_bytes(self.model_config, self.config.block_size, self.dtype)
        blocks = int(gib * GIB // per_block)
        if blocks < 1:
            raise InvalidRequestError(
                f"kv_cache_memory {gib} GiB holds no block of {per_block} bytes", "kv_cache_memory"
            )
        return blocks

    def _max_model_len(self, num_blocks: int) -> int:
        context = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            context = min(context, self.model_config.sliding_window)
        wanted = self.config.max_model_len
        if wanted is not None and wanted > context:
            raise InvalidRequestError(
                f"max_model_len {wanted} exceeds the model's context length {context}", "max_model_len"
            )
        length = wanted or context
        capacity = num_blocks * self.config.block_size
        if capacity < length:
            logger.warning(
                "the KV cache holds %d tokens, fewer than the context length %d: "
                "max_model_len lowered to %d (raise --kv-cache-memory for longer requests)",
                capacity, length, capacity,
            )
            length = capacity
        return length

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        add_special_tokens: bool = True,
        request_id: int | None = None,
        arrival_time: float | None = None,
    ) -> int:
        """Queue a request; returns its id. `prompt` may be text or token ids. `request_id` is one
        from `reserve_request_id` (callers that need the id before the request is added)."""
        params = sampling_params or SamplingParams()
        if prompt_token_ids is None and prompt is not None and not isinstance(prompt, str):
            prompt, prompt_token_ids = None, prompt
        token_ids = self.prompt_token_ids(prompt, prompt_token_ids, add_special_tokens)
        room = self.max_model_len - len(token_ids) + 1  # the last sampled token needs no KV slot
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        group_id = self.reserve_request_id() if request_id is None else request_id
        arrival = time.monotonic() if arrival_time is None else arrival_time
        sequences: list[Request] = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + index)
            sequence_id = group_id if index == 0 else self.reserve_request_id()
            sequences.append(
                Request(
                    request_id=sequence_id,
                    prompt_token_ids=token_ids,
                    sampling_params=child_params,
                    max_tokens=max_tokens,
                    prompt=prompt,
                    group_id=group_id,
                    index=index,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                )
            )
        group = RequestGroup(
            group_id, prompt, token_ids, sequences,
            [SequenceText(self.tokenizer, seq.sampling_params) for seq in sequences],
        )
        self._groups[group_id] = group
        for index, seq in enumerate(sequences):
            self._sequences[seq.request_id] = (group, index)
            # n > 1: the other sequences share the first one's prompt blocks instead of
            # computing the same prompt again.
            self.scheduler.add_request(seq, fork_from=sequences[0] if index else None)
        return group_id

    def reserve_request_id(self) -> int:
        """A fresh request id (thread-safe: `next` on a count is atomic)."""
        return next(self._ids)

    def prompt_token_ids(
        self, prompt: str | None, token_ids: Sequence[int] | None, add_special_tokens: bool = True
    ) -> list[int]:
        """The prompt as validated token ids (tokenized if text). Touches no engine state, so
        servers may call it from any thread before queueing the request."""
        if token_ids is not None:
            ids = list(token_ids)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt_token_ids contains {bad[:3]}, outside the vocabulary [0, {vocab})",
                    "prompt_token_ids",
                )
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            raise InvalidRequestError("a prompt (text or token ids) is required", "prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, more than the model's context "
                f"(max_model_len {self.max_model_len})",
                "prompt",
            )
        return ids

    def abort_request(self, group_id: int) -> None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        group = self._groups.pop(group_id, None)
        if group is None:
            return
        for seq in group.sequences:
            if not seq.finished:
                self.scheduler.finish_request(seq, RequestStatus.FINISHED_ABORTED)
            self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[OutputDelta]:
        """Run one scheduled batch; returns what each touched sequence produced."""
        clock = PhaseClock(self.timings)
        scheduled = self.scheduler.schedule()
        clock.lap("schedule")
        if scheduled.empty:
            stuck = self.scheduler.stuck_request()
            if stuck is None:
                return []
            return self._fail([stuck], "the request needs more KV cache blocks than exist")
        for request in scheduled.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
        try:
            result = self.runner.execute(scheduled, clock)
        except Exception as exc:  # keep serving the other requests
            logger.exception("model step failed; ending the %d requests in it", len(scheduled.requests))
            return self._fail(scheduled.requests, f"{type(exc).__name__}: {exc}")
        self.scheduler.update_after_step(scheduled)
        deltas = []
        logprobs = result.logprobs or [None] * len(result.requests)
        for request, token_id, logprob in zip(result.requests, result.token_ids, logprobs, strict=True):
            try:
                deltas.append(self._append_token(request, token_id, logprob))
            except Exception as exc:
                logger.exception("post-processing request %d failed", request.request_id)
                deltas.extend(self._fail([request], f"{type(exc).__name__}: {exc}"))
        clock.lap("update")
        self.timings.steps += 1
        return deltas

    def _append_token(self, request: Request, token_id: int, logprob: TokenLogprob | None) -> OutputDelta:
        group, index = self._sequences[request.request_id]
        text = group.texts[index]
        params = request.sampling_params
        request.append_token(token_id)
        self.stats.num_generation_tokens += 1
        if request.num_output_tokens == 1:
            self.stats.num_prompt_tokens += request.num_prompt_tokens
        stop_string = text.add_token(token_id, logprob)

        status = None
        if token_id in request.eos_token_ids and not params.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
        elif token_id in params.stop_token_ids:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        elif stop_string is not None:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
        elif request.num_output_tokens >= request.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish_request(request, status)
        return self._delta(group, request, [token_id], [logprob] if logprob else None,
                           stopped_by_string=stop_string is not None)

    def _delta(
        self,
        group: RequestGroup,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        stopped_by_string: bool = False,
        error: str | None = None,
    ) -> OutputDelta:
        text = group.texts[request.index]
        delta = OutputDelta(
            request_id=group.group_id,
            index=request.index,
            token_ids=token_ids,
            text=text.take_delta(request.finished, stopped_by_string),
            finished=request.finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            error=error,
        )
        if request.finished:
            request.finished_time = time.monotonic()
            self.stats.num_finished += 1
            self._forget(request)
            if group.finished and self._groups.pop(group.group_id, None) is not None:
                delta.output = group.to_output()
        return delta

    def _forget(self, request: Request) -> None:
        self._sequences.pop(request.request_id, None)
        self.runner.release(request.request_id)

    def _fail(self, requests: list[Request], message: str) -> list[OutputDelta]:
        deltas = []
        for request in requests:
            if request.finished:
                continue
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
            entry = self._sequences.get(request.request_id)
            if entry is not None:
                deltas.append(self._delta(entry[0], request, [], None, error=message))
        return deltas

    # -- the seed's convenience API -------------------------------------------------------
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_on_eos: bool = True,
        do_sample: bool = False,
        seed: int | None = None,
    ) -> str:
        return "".join(
            self.stream_generate(prompt, max_new_tokens, temperature, top_k, top_p, stop_on_eos, do_sample, seed)
        )

    def stream_generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_on_eos: bool = True,
        do_sample: bool = False,
        seed: int | None = None,
    ) -> Iterator[str]:
        """Yields text pieces of one request as they are generated (other queued requests run too)."""
        params = SamplingParams.from_seed_args(
            max_new_tokens, temperature, top_k, top_p, stop_on_eos, do_sample, seed
        )
        request_id = self.add_request(prompt, params)
        try:
            while True:
                for delta in self.step():
                    if delta.request_id != request_id:
                        continue
                    if delta.error:
                        raise RuntimeError(f"generation failed: {delta.error}")
                    if delta.text:
                        yield delta.text
                    if delta.finished:
                        return
        finally:
            self.abort_request(request_id)

