"""Continuous batching in the style of vLLM v1: one token budget per step, no separate prefill and
decode phases, and the one place where a request's state changes.

`schedule()` gives each request `num_tokens - num_computed_tokens` new tokens (capped by what is left
of the budget, so long prompts are prefilled in chunks that share steps with decodes) and returns a
`SchedulerOutput` that tells the model runner only what changed. `update_from_output()` takes the
runner's samples: it advances the computed tokens, appends the sampled tokens, decides every stop
the engine core can see (EOS, stop token ids, max tokens) and frees finished requests.

A pooling request (an embedding) is scheduled like any prompt, chunks included, and ends with the
step that computes its last prompt token, carrying the pooled vector the runner returned for it.

It knows requests and blocks, never tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from roseinfer.common.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from roseinfer.config import SpeculativeConfig
from roseinfer.core.kv_cache import KVCacheCoordinator
from roseinfer.core.request import Request, RequestStatus
from roseinfer.core.spec_decode import NgramProposer
from roseinfer.core.structured_output_manager import StructuredOutputManager
from roseinfer.outputs import TokenLogprob


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheCoordinator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        fork_prompts: bool = True,
    ) -> None:
        self.kv_cache = kv_cache
        # n > 1: whether a group's other sequences share the first one's computed prompt. Not for a
        # model with recurrent layers: their state after the prompt is not in the shared blocks.
        self.fork_prompts = fork_prompts
        self.structured_output = structured_output_manager
        self.proposer = NgramProposer(speculative_config) if speculative_config is not None else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # n > 1: the other sequences of a group wait for the first one's prompt, then share its
        # blocks (parent request id -> siblings) instead of computing the same prompt again.
        self._awaiting_fork: dict[str, list[Request]] = {}
        self._finished_req_ids: list[str] = []  # the runner knew them; told at the next schedule
        self._error_outputs: list[EngineCoreOutput] = []  # ended while scheduling (a bad grammar)
        self._preempted_this_step = False
        self._unschedulable: Request | None = None  # found too big for the whole pool this step
        self.stats = SchedulerStats()

    # -- queues ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. With `request.fork_of` (a sequence of the same prompt added before,
        still waiting), it takes a copy of that request's blocks once its prompt is computed."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        constrained = not request.is_pooling and request.sampling_params.structured_outputs is not None
        needs_masks = constrained or (request.reasoning is not None and request.reasoning.budget is not None)
        if needs_masks and self.structured_output is None:
            raise ValueError("this scheduler has no structured-output manager")
        if constrained:
            self.structured_output.add_request(request)
        parent = self.requests.get(request.fork_of) if request.fork_of is not None else None
        if (self.fork_prompts and parent is not None and parent.status == RequestStatus.WAITING
                and not parent.num_computed_tokens):
            self._awaiting_fork.setdefault(parent.request_id, []).append(request)
        else:
            self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(s) for s in self._awaiting_fork.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside a step (aborted, or failed with the step that ran them):
        leave the queues, free their blocks. Unknown or finished ids are ignored."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self._leave_waiting(request)
        request.status = status
        if self.structured_output is not None:
            self.structured_output.release(request)  # a compile nobody waits for stops holding a seat
        self.kv_cache.free(request.request_id)
        del self.requests[request.request_id]
        if request.synced_block_ids is not None:
            self._finished_req_ids.append(request.request_id)
        # Siblings still waiting for this request's prompt compute it themselves.
        self.waiting.extend(self._awaiting_fork.pop(request.request_id, []))

    def _leave_waiting(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
            return
        for parent_id, siblings in list(self._awaiting_fork.items()):
            if request in siblings:
                siblings.remove(request)
                if not siblings:
                    del self._awaiting_fork[parent_id]
                return

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        scheduled: list[tuple[Request, int]] = []
        budget = self.max_num_batched_tokens
        self._preempted_this_step = False
        self._unschedulable = None

        # Running requests first, oldest first; preempt from the newest end when blocks run out.
        # A decoding request may add draft tokens to verify (speculative decoding).
        spec: dict[str, list[int]] = {}
        speculate = self.proposer is not None and len(self.running) <= self.proposer.config.disable_by_batch_size
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self.kv_cache.align_prefill(request.num_computed_tokens, min(
                request.num_tokens - request.num_computed_tokens, budget), request.num_prompt_tokens)
            drafts = []
            if speculate and num_new == 1 and not request.is_pooling:
                room = min(request.max_tokens - request.num_output_tokens - 1, budget - 1)
                drafts = self.proposer.propose(request, room)
            if not self._allocate_or_preempt(request, num_new + len(drafts)):
                break  # the request itself was preempted: nothing after it is left running
            if drafts:
                spec[request.request_id] = drafts
            scheduled.append((request, num_new + len(drafts)))
            budget -= num_new + len(drafts)
            index += 1

        # Then waiting requests, in arrival order, while seats, budget and blocks allow; a request
        # whose grammar is still compiling is passed over, keeping its place in the queue.
        # After a preemption nothing new is admitted: the pool is already too tight.
        passed_over: list[Request] = []
        while not self._preempted_this_step and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.waiting[0]
            if self.structured_output is not None and not self.structured_output.is_ready(request):
                passed_over.append(self.waiting.popleft())
                continue
            if request.grammar_error is not None:
                self._finish(request, RequestStatus.FINISHED_ERROR)
                self._error_outputs.append(EngineCoreOutput(
                    request.request_id, [], finish_reason="error", error=request.grammar_error,
                    error_param=request.grammar_error_param,
                ))
                continue
            cached = self._cached_prefix(request)
            num_cached = self.kv_cache.cached_tokens(cached)
            num_new = self.kv_cache.align_prefill(num_cached, min(request.num_tokens - num_cached, budget),
                                                  request.num_prompt_tokens)
            if not self.kv_cache.allocate_slots(request.request_id, num_cached, num_new, cached,
                                                request.num_prompt_tokens):
                if not self.running:  # nothing will ever free blocks for it
                    self._unschedulable = request
                break
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if not request.num_preemptions:
                request.num_cached_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))

        out = self._scheduler_output(scheduled)
        out.scheduled_spec_decode_tokens = spec
        return out

    def _cached_prefix(self, request: Request) -> list[int]:
        """The prefix-cache blocks a request can start from. Mean pooling needs the hidden state of
        every prompt token, which cached blocks do not hold: it computes its whole prompt."""
        if request.is_pooling and request.pooling_params.pooling_type == "mean":
            return []
        return self.kv_cache.find_cached_prefix(request.token_ids, request.cache_salt, request.kv_variant)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> bool:
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens, num_new,
                                               num_prompt_tokens=request.num_prompt_tokens):
            victim = self.running.pop()  # the newest running request
            self._preempt(victim)
            self._preempted_this_step = True
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it waits at the front and is recomputed from scratch later."""
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def stuck_request(self) -> Request | None:
        """A waiting request that can never run: the last schedule found no room for it with
        nothing running that could free blocks."""
        request = self._unschedulable
        if request is not None and request.status == RequestStatus.WAITING and not self.running:
            return request
        return None

    def waiting_for_grammars(self) -> list[Request]:
        return [r for r in self.waiting if r.grammar_future is not None and not r.grammar_future.done()]

    def _scheduler_output(self, scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        now = time.monotonic()
        for request, num_new in scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            table = self.kv_cache.block_table(request.request_id)
            if request.synced_block_ids is None:
                out.scheduled_new_reqs.append(self._new_request_data(request, table))
            else:
                out.scheduled_cached_reqs.append(CachedRequestData(
                    req_id=request.request_id,
                    new_token_ids=request.token_ids[request.num_synced_tokens :],
                    block_ids=list(table) if table != request.synced_block_ids else None,
                    num_computed_tokens=request.num_computed_tokens,
                ))
            request.num_synced_tokens = request.num_tokens
            request.synced_block_ids = list(table)
            out.num_scheduled_tokens[request.request_id] = num_new
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        # Copies name their KV cache group (its pool) where it is not group 0.
        out.blocks_to_copy = [(c.src, c.dst, c.group) if c.group else (c.src, c.dst)
                              for c in self.kv_cache.take_pending_copies()]
        out.states_to_save = [(c.src, c.dst) for c in self.kv_cache.take_state_saves()]
        if self.structured_output is not None:
            sampling = [r for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens and not r.is_pooling]
            out.grammar_bitmask, out.structured_output_request_ids = self.structured_output.bitmask(sampling)
        if scheduled:
            stats = self.stats
            stats.num_steps += 1
            stats.max_batch_requests = max(stats.max_batch_requests, len(scheduled))
            stats.num_scheduled_tokens += out.total_num_scheduled_tokens
        return out

    @staticmethod
    def _new_request_data(request: Request, table: list[list[int]]) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            eos_token_ids=sorted(request.eos_token_ids),
            block_ids=list(table),
            num_computed_tokens=request.num_computed_tokens,
            pooling_params=request.pooling_params,
            images=request.images,
        )

    def replay_output(self, scheduled: SchedulerOutput, req_ids: list[str]) -> SchedulerOutput:
        """Part of a step that failed, to run again: these requests with their whole state (the
        runner replaces what it holds of them, however far the failed step got), the same tokens
        to compute, and the step's block copies and finished ids (both safe to apply twice)."""
        out = SchedulerOutput(finished_req_ids=list(scheduled.finished_req_ids),
                              blocks_to_copy=list(scheduled.blocks_to_copy),
                              states_to_save=list(scheduled.states_to_save))
        for req_id in req_ids:
            request = self.requests[req_id]
            out.scheduled_new_reqs.append(self._new_request_data(request, self.kv_cache.block_table(req_id)))
            out.num_scheduled_tokens[req_id] = scheduled.num_scheduled_tokens[req_id]
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        constrained = [r for r in req_ids if r in scheduled.structured_output_request_ids]
        if scheduled.grammar_bitmask is not None and constrained:  # their rows of the step's bitmask
            out.grammar_bitmask = scheduled.grammar_bitmask[[scheduled.structured_output_request_ids[r]
                                                             for r in constrained]]
            out.structured_output_request_ids = {r: row for row, r in enumerate(constrained)}
        out.scheduled_spec_decode_tokens = {r: scheduled.scheduled_spec_decode_tokens[r] for r in req_ids
                                            if r in scheduled.scheduled_spec_decode_tokens}
        return out

    # -- after the step ---------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Record the computed tokens, append the samples, stop and free finished requests."""
        sampled = {req_id: row for row, req_id in enumerate(runner_output.req_ids)}
        outputs, self._error_outputs = self._error_outputs, []
        stuck = self.stuck_request() if scheduler_output.empty else None
        if stuck is not None:  # it ends with an error instead of stalling the engine
            self._finish(stuck, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(
                stuck.request_id, [], finish_reason="error",
                error=f"the request needs more KV cache blocks than the {self.kv_cache.num_blocks} that exist",
            ))
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += num_new
            row = sampled.get(req_id)
            new_tokens = runner_output.sampled_token_ids[row] if row is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:  # the rejected drafts' K/V are not the sequence's: roll them back
                accepted = max(len(new_tokens) - 1, 0)
                request.num_computed_tokens -= len(drafts) - accepted
                self.kv_cache.free_tail(req_id, request.num_computed_tokens)
                self.proposer.record(request, len(drafts), accepted)
                self.stats.num_draft_tokens += len(drafts)
                self.stats.num_accepted_tokens += accepted
            output = status = None
            if request.is_pooling:
                output, status = self._pooled(request, runner_output)
            elif row is not None:
                logprobs = runner_output.logprobs[row] if runner_output.logprobs is not None else None
                output, status = self._append_samples(request, new_tokens, logprobs)
            computed = min(request.num_computed_tokens, request.num_tokens)  # a stop drops later drafts
            self.kv_cache.cache_computed_blocks(
                req_id, request.token_ids, computed, request.cache_salt, request.kv_variant
            )
            if req_id in self._awaiting_fork and request.num_computed_tokens >= request.num_prompt_tokens:
                self._fork_siblings(request)
            if status is not None:
                self._finish(request, status)
            if output is not None:
                outputs.append(output)
        return EngineCoreOutputs(outputs, self.make_stats())

    def _append_samples(
        self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob] | None
    ) -> tuple[EngineCoreOutput, RequestStatus | None]:
        """Append sampled tokens up to the first that ends the request; the caller finishes it."""
        params = request.sampling_params
        appended = 0
        status = None
        error = None
        for token_id in token_ids:
            request.token_ids.append(token_id)
            appended += 1
            # A thinking model's grammar constrains its answer only, not its thinking.
            in_answer = request.reasoning is None or request.reasoning.advance(token_id)
            grammar = request.grammar if in_answer else None
            if grammar is not None and not grammar.accept_tokens([token_id]):
                status, error = RequestStatus.FINISHED_ERROR, f"structured output: {grammar.error}"
            elif token_id in request.eos_token_ids and not params.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
            elif grammar is not None and grammar.is_terminated():  # the output is complete
                status = RequestStatus.FINISHED_STOPPED
            elif request.num_output_tokens >= request.max_tokens:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                break
        output = EngineCoreOutput(
            request.request_id,
            token_ids[:appended],
            logprobs[:appended] if logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            first_scheduled_time=request.first_scheduled_time,
            grammar_compile_time=request.grammar_compile_time,
        )
        if status is not None:
            output.finish_reason, output.stop_reason, output.error = status.value, request.stop_reason, error
        return output, status

    def _pooled(
        self, request: Request, runner_output: ModelRunnerOutput
    ) -> tuple[EngineCoreOutput | None, RequestStatus | None]:
        """A pooling request whose whole prompt is computed ends now, with its pooled vector."""
        if request.num_computed_tokens < request.num_prompt_tokens:
            return None, None  # a chunk of its prompt ran; more to come
        output = EngineCoreOutput(
            request.request_id, [], finish_reason=RequestStatus.FINISHED_STOPPED.value,
            num_cached_tokens=request.num_cached_tokens, first_scheduled_time=request.first_scheduled_time,
            pooled=runner_output.pooled.get(request.request_id),
        )
        if output.pooled is None:  # never expected: say so rather than hand out nothing
            output.finish_reason = RequestStatus.FINISHED_ERROR.value
            output.error = "the model runner returned no pooled hidden state for the request"
            return output, RequestStatus.FINISHED_ERROR
        return output, RequestStatus.FINISHED_STOPPED

    def _fork_siblings(self, parent: Request) -> None:
        """Each sibling shares the parent's blocks and recomputes only the last prompt token (for
        its own first sample), writing it into a private copy of the last block."""
        for sibling in self._awaiting_fork.pop(parent.request_id):
            if len(self.running) >= self.max_num_seqs:
                self.waiting.append(sibling)  # no seat: it computes its prompt later on its own
                continue
            self.kv_cache.fork(parent.request_id, sibling.request_id)
            sibling.num_computed_tokens = parent.num_prompt_tokens - 1
            sibling.status = RequestStatus.RUNNING
            self.running.append(sibling)

    def make_stats(self) -> SchedulerStats:
        stats = self.stats
        prefix = self.kv_cache.prefix_stats
        stats.num_running = len(self.running)
        stats.num_waiting = self.num_waiting
        stats.kv_cache_usage = self.kv_cache.usage
        stats.prefix_cache_queries, stats.prefix_cache_hits = prefix.queries, prefix.hits
        return SchedulerStats(**vars(stats))
