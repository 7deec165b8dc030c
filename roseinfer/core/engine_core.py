"""The engine core: the scheduler, the KV cache manager and an executor, stepped one batch at a time.

    step():  scheduler.schedule() -> SchedulerOutput
             executor.execute_model(SchedulerOutput) -> ModelRunnerOutput
             scheduler.update_from_output(...) -> EngineCoreOutputs

It takes `EngineCoreRequest`s and aborts and gives back `EngineCoreOutputs`; it never sees text.
The same class runs in the caller's thread (LLMEngine), in a background thread or in a process of
its own (AsyncLLM, see core_client.py and engine_core_proc.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable

from roseinfer.common.kv_cache_spec import group_pool_sizes, model_kv_cache_groups
from roseinfer.common.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.core.kv_cache import KVCacheCoordinator
from roseinfer.core.request import Request, RequestStatus
from roseinfer.core.scheduler import Scheduler
from roseinfer.core.structured_output_manager import StructuredOutputManager
from roseinfer.errors import EngineDeadError, ExecutorFailedError
from roseinfer.executor import Executor, executor_class
from roseinfer.step_timings import PhaseClock, StepTimings

logger = logging.getLogger("roseinfer")


def kv_cache_coordinator(config: EngineConfig, model_config: ModelConfig) -> KVCacheCoordinator:
    """The KV coordinator over one manager per KV cache group (common/kv_cache_spec.py), each with
    the pool the plan sized (core/kv_pool_plan.py)."""
    specs = model_kv_cache_groups(model_config)
    sizes = group_pool_sizes(specs, config.num_kv_blocks, config.num_kv_blocks_sliding, config.max_num_seqs)
    return KVCacheCoordinator.from_specs(specs, sizes, config.block_size, config.enable_prefix_caching,
                                         config.max_num_seqs, config.num_state_snapshots or 0)


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.timings = StepTimings()
        started = time.perf_counter()
        self.executor = executor or executor_class(config)(config, model_config, self.timings)
        self.kv_cache = kv_cache_coordinator(config, model_config)
        self.structured_output_manager = StructuredOutputManager(config, model_config)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.structured_output_manager,
            config.speculative_config, fork_prompts=self.kv_cache.shares_prompts,
        )
        self.long_rope_from = model_config.long_rope_from
        # Whether a failed step may run again in parts to find the request that fails it: not for a
        # model with recurrent layers, whose states a step that failed part-way may already have
        # advanced (its requests end with an error instead; nothing answers wrong).
        self.steps_rerun = model_config.recurrent is None
        self.dead_reason: str | None = None  # set when the executor failed: no step can run again
        logger.debug("engine core ready in %.1fs", time.perf_counter() - started)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine cannot run requests: {self.dead_reason}")
        core_request = Request.from_engine_core_request(request)
        if self.long_rope_from is not None and core_request.num_prompt_tokens > self.long_rope_from:
            # LongRoPE: the whole prompt is rotated with the long frequencies (layers/rotary.long_rope),
            # so its blocks must not be shared with those of shorter prompts.
            core_request.kv_variant = "long_rope;" + (core_request.kv_variant or "")
        self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """End these requests now and free their blocks; returns the ids that were still running."""
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [request.request_id for request in ended]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        self.kv_cache.reset_prefix_cache()

    # -- one step -------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        clock = PhaseClock(self.timings)
        scheduler_output = self.scheduler.schedule()
        clock.lap("schedule")
        failed: list[EngineCoreOutput] = []
        if scheduler_output.empty:
            runner_output = ModelRunnerOutput()
            pending = self.scheduler.waiting_for_grammars()
            if pending and not self.scheduler.running:  # nothing can run until one compiles
                concurrent.futures.wait([r.grammar_future for r in pending], timeout=0.05,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            try:
                runner_output = self.executor.execute_model(scheduler_output)
            except ExecutorFailedError as exc:  # a worker is gone: nothing can run any more
                return self.fail_all(str(exc))
            except Exception as exc:
                if not self.steps_rerun:
                    logger.exception("a model step of %d requests failed; they end with an error (a hybrid "
                                     "model's step cannot be run again: its recurrent states may have moved on)",
                                     len(scheduler_output.num_scheduled_tokens))
                    runner_output = ModelRunnerOutput()
                    ended = self.scheduler.finish_requests(list(scheduler_output.num_scheduled_tokens),
                                                           RequestStatus.FINISHED_ERROR)
                    failed = [EngineCoreOutput(r.request_id, [], finish_reason="error",
                                               error=f"{type(exc).__name__}: {exc}") for r in ended]
                else:
                    logger.exception("a model step of %d requests failed; running it again in parts to find "
                                     "the requests that fail it", len(scheduler_output.num_scheduled_tokens))
                    try:
                        runner_output, failed = self._isolate_failure(scheduler_output)
                    except ExecutorFailedError as failure:
                        return self.fail_all(str(failure))
            clock.last = time.perf_counter()  # the executor timed its own phases
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.outputs.extend(failed)
        clock.lap("update")
        if not scheduler_output.empty:
            self.timings.steps += 1
        return outputs

    def _isolate_failure(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, list[EngineCoreOutput]]:
        """Bisect a failed step: run its halves again (the scheduler's state is untouched until
        the step's output is applied), split every part that fails, and end only the requests
        that fail alone. A fault of one request costs about 2 log2(batch) extra runs."""
        parts: list[ModelRunnerOutput] = []
        errors: dict[str, str] = {}
        pending = _halves(list(scheduler_output.num_scheduled_tokens))
        while pending:
            group = pending.pop()
            try:
                parts.append(self.executor.execute_model(self.scheduler.replay_output(scheduler_output, group)))
            except ExecutorFailedError:
                raise
            except Exception as exc:
                if len(group) > 1:
                    pending.extend(_halves(group))
                    continue
                errors[group[0]] = f"{type(exc).__name__}: {exc}"
                logger.error("request %s fails the model step on its own (%s); it ends with an error",
                             group[0], errors[group[0]])
        failed = self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason="error", error=errors[r.request_id])
                   for r in failed]
        return _merge(parts), outputs

    def fail_all(self, reason: str) -> EngineCoreOutputs:
        """The executor failed: end every request with an error and refuse new ones."""
        logger.error("the executor failed (%s); ending all %d requests", reason, len(self.scheduler.requests))
        self.dead_reason = reason
        return self._fail(list(self.scheduler.requests), reason)

    def _fail(self, request_ids: Iterable[str], message: str) -> EngineCoreOutputs:
        failed = self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ERROR)
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason="error", error=message) for r in failed]
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.structured_output_manager.shutdown()


def _halves(req_ids: list[str]) -> list[list[str]]:
    if len(req_ids) < 2:
        return [req_ids]
    middle = len(req_ids) // 2
    return [req_ids[:middle], req_ids[middle:]]


def _merge(parts: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """One output of several runs' outputs (requests that asked for no logprobs get None)."""
    merged = ModelRunnerOutput()
    logprobs: list = []
    for part in parts:
        merged.req_ids += part.req_ids
        merged.sampled_token_ids += part.sampled_token_ids
        logprobs += part.logprobs if part.logprobs is not None else [None] * len(part.req_ids)
        merged.pooled |= part.pooled
    merged.logprobs = logprobs if any(p.logprobs is not None for p in parts) else None
    return merged
