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

from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.core.kv_cache_manager import KVCacheManager
from roseinfer.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
)
from roseinfer.core.scheduler import Scheduler
from roseinfer.core.structured_output_manager import StructuredOutputManager
from roseinfer.errors import EngineDeadError, ExecutorFailedError
from roseinfer.executor import Executor, executor_class
from roseinfer.request import Request, RequestStatus
from roseinfer.step_timings import PhaseClock, StepTimings

logger = logging.getLogger("roseinfer")


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.timings = StepTimings()
        started = time.perf_counter()
        self.executor = executor or executor_class(config)(config, model_config, self.timings)
        self.kv_cache = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.structured_output_manager = StructuredOutputManager(config, model_config)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.structured_output_manager,
            config.speculative_config,
        )
        self.dead_reason: str | None = None  # set when the executor failed: no step can run again
        logger.debug("engine core ready in %.1fs", time.perf_counter() - started)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine cannot run requests: {self.dead_reason}")
        self.scheduler.add_request(Request.from_engine_core_request(request))

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
            except Exception as exc:  # keep serving the requests that were not in this step
                logger.exception("model step failed; ending the %d requests in it",
                                 len(scheduler_output.num_scheduled_tokens))
                return self._fail(scheduler_output.num_scheduled_tokens, f"{type(exc).__name__}: {exc}")
            clock.last = time.perf_counter()  # the executor timed its own phases
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        clock.lap("update")
        if not scheduler_output.empty:
            self.timings.steps += 1
        return outputs

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
