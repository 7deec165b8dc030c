"""The synchronous engine under `LLM.generate` / `LLM.chat` / `LLM.embed`: requests in, one step at
a time, `RequestOutput`s (`PoolingRequestOutput`s for pooling requests) out; the engine core runs
in the caller's thread."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from roseinfer.config import EngineConfig
from roseinfer.core.engine_core import EngineCore
from roseinfer.engine.front_end import EngineFrontEnd
from roseinfer.engine.input_processor import ProcessedRequest, PromptType
from roseinfer.engine.stats import StatLogger
from roseinfer.outputs import PoolingRequestOutput, RequestOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams
from roseinfer.step_timings import PhaseClock

if TYPE_CHECKING:
    from roseinfer.core.kv_cache import KVCacheCoordinator
    from roseinfer.core.scheduler import Scheduler
    from roseinfer.worker.model_runner import ModelRunner


class LLMEngine(EngineFrontEnd):
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        super().__init__(config)
        self.engine_core = EngineCore(config, self.model_config)
        self.timings = self.engine_core.timings
        self._request_counter = itertools.count()
        # Fed after every step with the engine core's stats snapshot and the step's figures;
        # append one to watch an engine built elsewhere.
        self.stat_loggers: list[StatLogger] = []
        self.log_ready(time.perf_counter() - started)

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model=model, **engine_args))

    # -- views of the engine core's parts (in this process), for tests, tools and debugging ----
    @property
    def scheduler(self) -> Scheduler:
        return self.engine_core.scheduler

    @property
    def kv_cache(self) -> KVCacheCoordinator:
        return self.engine_core.kv_cache

    @property
    def model_runner(self) -> ModelRunner:
        """The in-process executor's runner (under tensor parallelism, rank 0's)."""
        return self.engine_core.executor.model_runner

    # -- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        """A fresh request id ("0", "1", ...), shared by every API over this engine."""
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        add_special_tokens: bool = True,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Check, tokenize and queue a request (raises InvalidRequestError, leaving nothing queued);
        `cache_salt` as vLLM's (prefix-cache blocks are shared only within one salt)."""
        self.add_processed_request(self.input_processor.process(
            request_id, prompt, params or SamplingParams(), add_special_tokens=add_special_tokens,
            arrival_time=arrival_time, cache_salt=cache_salt,
        ))

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queue a request that `input_processor.process` has checked already, possibly in another
        thread (the seed's OnlineScheduler checks in its callers' threads, queues in the stepping one)."""
        for core_request in self.register_request(processed):
            self.engine_core.add_request(core_request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks. Unknown or finished ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            sequence_ids, _ = self.output_processor.abort_request(request_id)
            self.engine_core.abort_requests(sequence_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        self.engine_core.reset_prefix_cache()

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one scheduled batch; returns the outputs of the requests it touched."""
        core_outputs = self.engine_core.step()
        clock = PhaseClock(self.timings)
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        for stat_logger in self.stat_loggers:
            stat_logger.record(core_outputs.scheduler_stats, processed.iteration_stats)
        clock.lap("output")
        return processed.request_outputs
