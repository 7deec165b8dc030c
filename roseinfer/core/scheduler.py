"""Continuous batching in the style of vLLM v1: one token budget per step, no separate prefill and
decode phases. Each request gets `num_tokens - num_computed_tokens` new tokens (capped by what is
left of the budget, so long prompts are prefilled in chunks that share steps with decodes).

It knows requests and blocks, never tensors: it tells the model runner which requests run this step
and how many tokens each, and the KV cache manager where their blocks are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from roseinfer.core.kv_cache_manager import BlockCopy, KVCacheManager
from roseinfer.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """The step's batch: requests in order, how many new tokens each, and block copies to do first."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    blocks_to_copy: list[BlockCopy] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    max_batch_requests: int = 0  # the most requests run together in one step
    max_batch_tokens: int = 0
    num_scheduled_tokens: int = 0  # tokens run through the model, prompts and outputs


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # n > 1: the other sequences of a group wait for the first one's prompt, then share its
        # blocks (parent request id -> siblings) instead of computing the same prompt again.
        self._awaiting_fork: dict[int, list[Request]] = {}
        self.stats = SchedulerStats()

    # -- queues ---------------------------------------------------------------------------
    def add_request(self, request: Request, fork_from: Request | None = None) -> None:
        """Queue a request; with `fork_from` (a sequence of the same prompt added before it), it
        takes a copy of that request's blocks once its prompt is computed."""
        request.status = RequestStatus.WAITING
        if fork_from is not None and fork_from.status == RequestStatus.WAITING and not fork_from.num_computed_tokens:
            self._awaiting_fork.setdefault(fork_from.request_id, []).append(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._awaiting_fork)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(s) for s in self._awaiting_fork.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted, error): leave the queues, free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self._leave_waiting(request)
        request.status = status
        self.kv_cache.free(request.request_id)
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
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # Running requests first, oldest first; preempt from the newest end when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request itself was preempted: nothing after it is left running
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            index += 1

        # Then waiting requests, in arrival order, while seats, budget and blocks allow.
        # After a preemption nothing new is admitted: the pool is already too tight.
        while (
            not out.preempted
            and self.waiting
            and len(self.running) < self.max_num_seqs
            and budget > 0
        ):
            request = self.waiting[0]
            cached = self.kv_cache.find_cached_prefix(request.token_ids)
            num_cached = len(cached) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(request.request_id, num_cached, num_new, cached):
                break
            self.kv_cache.record_prefix_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if not request.num_preemptions:
                request.num_cached_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
            budget -= num_new

        out.blocks_to_copy = self.kv_cache.take_pending_copies()
        if out.requests:
            self.stats.num_steps += 1
            self.stats.max_batch_requests = max(self.stats.max_batch_requests, len(out.requests))
            self.stats.max_batch_tokens = max(self.stats.max_batch_tokens, out.total_tokens)
            self.stats.num_scheduled_tokens += out.total_tokens
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv_cache.allocate_slots(
            request.request_id, request.num_computed_tokens, num_new
        ):
            victim = self.running.pop()  # the newest running request
            self._preempt(victim)
            out.preempted.append(victim)
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

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Record the computed tokens, cache the blocks they filled and start the siblings of
        requests whose prompt is now computed; returns the requests that get a sample."""
        caught_up = []
        for request, num_new in zip(out.requests, out.num_new_tokens, strict=True):
            request.num_computed_tokens += num_new
            self.kv_cache.cache_computed_blocks(
                request.request_id, request.token_ids, request.num_computed_tokens
            )
            if request.num_computed_tokens == request.num_tokens:
                caught_up.append(request)
            if request.request_id in self._awaiting_fork and request.num_computed_tokens >= request.num_prompt_tokens:
                self._fork_siblings(request)
        return caught_up

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

    def stuck_request(self) -> Request | None:
        """A waiting request that can never run: nothing is running to free blocks for it."""
        if self.waiting and not self.running:
            return self.waiting[0]
        return None
