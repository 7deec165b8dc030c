"""The KV coordinator: the one surface the scheduler calls for a request's per-sequence memory, over
one single-kind manager per KV cache group (common/kv_cache_spec.py; the idea of vLLM v1's
KVCacheCoordinator): full attention (full_attention.py), sliding window (sliding_window.py) and
recurrent state (recurrent_state.py).

A request gets room only when every group has it (else nothing changes and it waits or is
preempted), and its block table is one list per group, in the groups' order. Prefix caching keys
are the same chained keys in every paged group (the same tokens give each group's layers the same
K/V); a hit of L tokens needs the full group's blocks of the whole prefix and each sliding group's
blocks of its window before L.

A model with a recurrent group resumes a prefix only where a snapshot of its state was kept at the
prefix's last block boundary (recurrent_state.py): the hit is the longest cached prefix that ends
at a registered snapshot. Snapshots are taken where a prompt's step ends on a block boundary, and
`align_prefill` makes prompt chunks end on them: a chunk cut by the token budget ends at a block
boundary, and a prompt's last full block ends a chunk of its own. Without snapshot slots (the pool
plan found them too costly) such a model takes no hits. It forks no prompts either way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from roseinfer.common.kv_cache_spec import KVCacheGroupSpec
from roseinfer.core.kv_cache.block_pool import BlockCopy, PrefixCacheStats
from roseinfer.core.kv_cache.full_attention import KVCacheManager
from roseinfer.core.kv_cache.recurrent_state import RecurrentStateManager
from roseinfer.core.kv_cache.sliding_window import SlidingWindowManager

logger = logging.getLogger("roseinfer")


class SingleKindManager(Protocol):
    """What the coordinator asks of each group's manager."""

    group: int
    block_tables: dict[int, list[int]]

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    def block_table(self, request_id: int) -> list[int]: ...
    def find_cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                           variant: str | None = None) -> list[int]: ...
    def cache_computed_blocks(self, request_id: int, token_ids: Sequence[int], num_computed: int,
                              cache_salt: str | None = None, variant: str | None = None) -> None: ...
    def plan_slots(self, request_id: int, num_computed: int, num_new: int, cached_blocks: Sequence[int] = ()): ...
    def commit_slots(self, request_id: int, plan) -> None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free_tail(self, request_id: int, num_tokens: int) -> None: ...
    def free(self, request_id: int) -> None: ...
    def take_pending_copies(self) -> list[BlockCopy]: ...
    def reset_prefix_cache(self) -> None: ...
    def check_invariants(self) -> None: ...


def group_manager(
    spec: KVCacheGroupSpec, size: int, group: int, block_size: int, enable_prefix_caching: bool, max_num_seqs: int,
    only_attention_group: bool, num_state_snapshots: int = 0,
) -> SingleKindManager:
    """The manager of one group: `size` blocks (or state slots, with `num_state_snapshots` snapshot
    slots beside them where prefix caching is on). A sliding window on every attention layer
    (Mistral) keeps the full-attention manager with that span, as one group."""
    if spec.kind == "recurrent":
        return RecurrentStateManager(size, group, num_state_snapshots if enable_prefix_caching else 0)
    if spec.kind == "sliding" and not only_attention_group:
        return SlidingWindowManager(size, block_size, spec.window, enable_prefix_caching, max_num_seqs, group)
    return KVCacheManager(size, block_size, enable_prefix_caching, max_num_seqs, spec.window, group)


class KVCacheCoordinator:
    def __init__(self, groups: Sequence[SingleKindManager]) -> None:
        self.groups = list(groups)
        self.paged = [group for group in self.groups if isinstance(group, KVCacheManager)]
        if not self.paged or self.groups[0] is not self.paged[0]:
            raise ValueError("a KV coordinator needs an attention group first")
        if any(isinstance(g, SlidingWindowManager) for g in self.paged) and self.paged[0].attention_span is not None:
            raise ValueError("sliding-window groups need a full-attention group first")
        if [group.group for group in self.groups] != list(range(len(self.groups))):
            raise ValueError("the groups' indices must be their places in the coordinator")
        self.block_size = self.paged[0].block_size
        self.state = next((group for group in self.groups if isinstance(group, RecurrentStateManager)), None)
        self.recurrent = self.state is not None
        self.enable_prefix_caching = self.paged[0].enable_prefix_caching and (
            self.state is None or self.state.num_snapshots > 0)
        if self.paged[0].enable_prefix_caching and self.state is not None and not self.state.num_snapshots:
            logger.info("prefix caching finds nothing for this model: its recurrent layers have no state "
                        "snapshot slots, so a cached prefix could not be resumed")
        # Whether steps keep state snapshots at block boundaries (recurrent_state.py).
        self.snapshots = self.state is not None and self.enable_prefix_caching
        # n > 1: whether a group's other sequences may share the first one's computed prompt.
        self.shares_prompts = not self.recurrent
        self.prefix_stats = PrefixCacheStats()

    @classmethod
    def from_specs(
        cls, specs: Sequence[KVCacheGroupSpec], sizes: Sequence[int], block_size: int,
        enable_prefix_caching: bool = True, max_num_seqs: int = 1, num_state_snapshots: int = 0,
    ) -> KVCacheCoordinator:
        only = sum(spec.paged for spec in specs) == 1
        return cls([group_manager(spec, size, group, block_size, enable_prefix_caching, max_num_seqs, only,
                                  num_state_snapshots)
                    for group, (spec, size) in enumerate(zip(specs, sizes, strict=True))])

    # -- queries --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """KV blocks of every attention group (state slots are not blocks)."""
        return sum(group.num_blocks for group in self.paged)

    @property
    def num_free_blocks(self) -> int:
        return sum(group.num_free_blocks for group in self.paged)

    @property
    def usage(self) -> float:
        """Fraction of all attention groups' blocks held by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: int) -> list[list[int]]:
        """One table per group (fresh lists: the scheduler keeps what it sent)."""
        return [list(group.block_table(request_id)) for group in self.groups]

    def cached_tokens(self, cached_blocks: Sequence[Sequence[int]]) -> int:
        """How many prompt tokens the blocks `find_cached_prefix` found hold."""
        return len(cached_blocks[0]) * self.block_size if cached_blocks else 0

    # -- prefix cache ---------------------------------------------------------------------
    def find_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None = None, variant: str | None = None
    ) -> list[list[int]]:
        """Per group, the cached blocks of the longest computed prefix of `token_ids` every group
        can start from, among those registered under the same `cache_salt` (empty lists: none).
        At least the last token is always left to compute (its logits are needed).

        One attention group: its blocks of the prefix. With sliding groups: the full group's
        blocks of the whole prefix, each sliding group's those its window reads after the prefix
        (RELEASED before them), so an evicted block inside a window shortens the hit."""
        none: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_prefix_caching:
            return none
        full = self.groups[0]
        if len(self.groups) == 1:
            return [full.find_cached_prefix(token_ids, cache_salt, variant)]
        keys = full.prefix_keys(token_ids, cache_salt, variant)
        found = full.cached_run(keys)
        sliding = [(group, group.cached_blocks(keys[: len(found)])) for group in self.paged[1:]]
        for hit in range(len(found), 0, -1):
            snapshot = self.state.snapshot(keys[hit - 1]) if self.state is not None else None
            if self.state is not None and snapshot is None:
                continue  # the recurrent layers could not resume here
            tables = iter([group.window_hit(cached, hit) for group, cached in sliding])
            hit_tables = [found[:hit] if index == 0 else [snapshot] if group is self.state else next(tables)
                          for index, group in enumerate(self.groups)]
            if all(table is not None for table in hit_tables):
                return hit_tables
        return none

    def record_prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count a lookup whose blocks were taken (for the hit-rate metrics)."""
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_cached_tokens

    def cache_computed_blocks(
        self, request_id: int, token_ids: Sequence[int], num_computed: int, cache_salt: str | None = None,
        variant: str | None = None,
    ) -> None:
        """Register the request's blocks that became full and computed (after each step)."""
        if not self.enable_prefix_caching:
            return
        for group in self.groups:
            group.cache_computed_blocks(request_id, token_ids, num_computed, cache_salt, variant)
        if self.snapshots:  # under the full group's keys of the request's blocks
            self.state.register_snapshots(request_id, self.paged[0].block_keys(request_id), self.block_size,
                                          num_computed)

    def align_prefill(self, num_computed: int, num_new: int, num_prompt_tokens: int) -> int:
        """How many of `num_new` prompt tokens after `num_computed` a step computes so that it ends
        where a state snapshot can be kept (a model with recurrent layers and prefix caching): at
        the prompt's last full block, and a chunk the budget cut short at its last block boundary.
        Unchanged otherwise."""
        if not self.snapshots or num_computed >= num_prompt_tokens:
            return num_new
        end = num_computed + num_new
        last_full = num_prompt_tokens // self.block_size * self.block_size
        if num_computed < last_full < end:
            return last_full - num_computed
        if end < num_prompt_tokens:
            aligned = end // self.block_size * self.block_size
            if aligned > num_computed:
                return aligned - num_computed
        return num_new

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self, request_id: int, num_computed: int, num_new: int, cached_blocks: Sequence[Sequence[int]] = (),
        num_prompt_tokens: int | None = None,
    ) -> bool:
        """Make room for `num_new` tokens written after `num_computed` cached ones, in every group
        or (returning False, changing nothing but the release of blocks behind a window) in none.

        `cached_blocks` (from `find_cached_prefix`, for a request that holds nothing yet) start its
        tables. A paged group allocates the blocks the new tokens need and, if the block they start
        in is shared with another request, replaces it by a private copy (copy-on-write); a
        recurrent group gives a new request its state slot."""
        cached = cached_blocks if cached_blocks and cached_blocks[0] else [()] * len(self.groups)
        plans = []
        for group, blocks in zip(self.groups, cached, strict=True):
            plan = group.plan_slots(request_id, num_computed, num_new, blocks)
            if plan is None:
                return False
            plans.append(plan)
        for group, plan in zip(self.groups, plans, strict=True):
            group.commit_slots(request_id, plan)
        end = num_computed + num_new
        if (self.snapshots and num_prompt_tokens is not None and num_new > 0 and end % self.block_size == 0
                and end <= num_prompt_tokens):
            self.state.schedule_snapshot(request_id, end)
        return True

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (n > 1 sampling after one prefill); only
        where `shares_prompts` (else it raises, changing nothing)."""
        if not self.shares_prompts:
            raise RuntimeError("a recurrent state cannot be shared between sequences (see recurrent_state.py)")
        for group in self.groups:
            group.fork(parent_id, child_id)

    def free_tail(self, request_id: int, num_tokens: int) -> None:
        """Free the request's blocks past the first `num_tokens` tokens (rejected draft tokens')."""
        for group in self.groups:
            group.free_tail(request_id, num_tokens)

    def free(self, request_id: int) -> None:
        for group in self.groups:
            group.free(request_id)

    def take_pending_copies(self) -> list[BlockCopy]:
        """Copies the runner makes before the step's forward: copy-on-write blocks, and snapshots
        into new requests' state slots."""
        return [copy for group in self.groups for copy in group.take_pending_copies()]

    def take_state_saves(self) -> list[BlockCopy]:
        """Copies the runner makes after the step's forward: sequences' states into snapshot slots."""
        return self.state.take_saves() if self.state is not None else []

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds."""
        for group in self.groups:
            group.reset_prefix_cache()

    # -- checks ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        for group in self.groups:
            group.check_invariants()
        tables = [group.block_tables for group in self.groups]
        if any(set(other) != set(tables[0]) for other in tables[1:]):
            raise AssertionError("a request holds a block table in some groups and not in others")
        paged = [group.block_tables for group in self.paged]
        if any(len(other[request]) != len(paged[0][request]) for other in paged[1:] for request in other):
            raise AssertionError("a request's block tables differ in length between groups")
