"""Property test of the KV coordinator (core/kv_cache/coordinator.py) over a hybrid model's
groups: a full-attention group and a sliding-window group over pools of their own, both small enough to run
out, under random allocate (with prefix-cache lookups) / append / draft-and-roll-back / fork /
free / end-of-step sequences, as in test_kv_cache_manager.py.

A shadow pool per group records which token each slot holds: after every operation each
request's full-group table reads back all its tokens and its sliding-group table those of its
window; a request holds no more sliding blocks than the window bound; a prefix-cache hit's blocks
hold the prefix in both groups; an allocation that fails in either group changes neither.
"""

import itertools

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from kv_cache_machine import RequestLifecycleMachine

from roseinfer.common.kv_cache_spec import (
    kv_group_windows,
    layer_kv_groups,
    sliding_blocks_per_sequence,
)
from roseinfer.core.kv_cache import (
    RELEASED,
    KVCacheCoordinator,
    KVCacheManager,
    SlidingWindowManager,
)

FULL_BLOCKS = 12
SLIDING_BLOCKS = 7
BLOCK_SIZE = 4
WINDOW = 5
MAX_CHUNK = BLOCK_SIZE + 2  # the most tokens one operation writes after the prompt
TOKENS = st.integers(0, 1)
SALTS = st.sampled_from([None, "a"])


class HybridBlockManagerMachine(RequestLifecycleMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheCoordinator([
            KVCacheManager(FULL_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True),
            SlidingWindowManager(SLIDING_BLOCKS, BLOCK_SIZE, WINDOW, enable_prefix_caching=True, group=1),
        ])
        self.pools = [{b: [None] * BLOCK_SIZE for b in range(n)} for n in (FULL_BLOCKS, SLIDING_BLOCKS)]
        self.tokens: dict[int, list[int]] = {}
        self.salts: dict[int, str | None] = {}
        self.ids = itertools.count()

    def _write(self, request_id: int, new_tokens: list[int], cached=()) -> bool:
        start = len(self.tokens[request_id])
        if not self.manager.allocate_slots(request_id, start, len(new_tokens), cached):
            return False
        for copy in self.manager.take_pending_copies():
            self.pools[copy.group][copy.dst] = list(self.pools[copy.group][copy.src])
        tables = self.manager.block_table(request_id)
        for position, value in enumerate(new_tokens, start):
            for pool, table in zip(self.pools, tables, strict=True):
                pool[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = value
            self.tokens[request_id].append(value)
        return True

    def _free_counts(self) -> list[int]:
        return [group.num_free_blocks for group in self.manager.groups]

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=3 * BLOCK_SIZE), salt=SALTS)
    def allocate(self, prompt: list[int], salt: str | None) -> None:
        request_id = next(self.ids)
        cached = self.manager.find_cached_prefix(prompt, salt)
        num_cached = self.manager.cached_tokens(cached)
        assert num_cached < len(prompt), "the last token must always be computed"
        assert len(cached) == 2 and len(cached[0]) == len(cached[1])
        event("prefix cache hit" if num_cached else "prefix cache miss")
        free_before = self._free_counts()
        self.tokens[request_id] = list(prompt[:num_cached])
        self.salts[request_id] = salt
        needed = -(-len(prompt) // BLOCK_SIZE) - len(cached[0])
        fits = all(needed <= group.pool.num_free_after_taking([b for b in blocks if b != RELEASED])
                   for group, blocks in zip(self.manager.groups, cached, strict=True))
        assert self._write(request_id, prompt[num_cached:], cached) == fits
        if not fits:
            del self.tokens[request_id], self.salts[request_id]
            assert all(request_id not in group.block_tables for group in self.manager.groups)
            assert self._free_counts() == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tail=st.lists(TOKENS, max_size=BLOCK_SIZE + 2), salt=SALTS)
    def allocate_with_a_shared_prefix(self, data, tail: list[int], salt: str | None) -> None:
        source = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
        prefix = source[: data.draw(st.integers(0, len(source)))]
        if prefix or tail:
            self.allocate(prefix + tail, salt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, min_size=1, max_size=MAX_CHUNK))
    def append(self, data, new_tokens: list[int]) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        full_before = list(self.manager.block_table(request_id)[0])
        if not self._write(request_id, new_tokens):
            # Neither group changed (the sliding group may have released blocks before its window).
            assert self.manager.block_table(request_id)[0] == full_before
            assert self.manager.groups[0].num_free_blocks <= FULL_BLOCKS
            event("an append ran out of blocks")

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), drafts=st.lists(TOKENS, min_size=1, max_size=4), accepted=st.integers(0, 4))
    def verify_drafts(self, data, drafts: list[int], accepted: int) -> None:
        """Speculative decoding: draft tokens written, the rejected ones rolled back (free_tail)
        before the step ends, so their blocks were never cached."""
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = len(self.tokens[request_id])
        if self._write(request_id, drafts):
            keep = before + min(accepted, len(drafts))
            self.manager.free_tail(request_id, keep)
            del self.tokens[request_id][keep:]

    @invariant()
    def every_request_reads_back_its_tokens(self) -> None:
        """All of them in the full group; in the sliding group those the next query sees."""
        for request_id, tokens in self.tokens.items():
            full, sliding = self.manager.block_table(request_id)
            assert len(full) == len(sliding) == -(-len(tokens) // BLOCK_SIZE)
            for pool, table, first in ((self.pools[0], full, 0),
                                       (self.pools[1], sliding, max(0, len(tokens) - WINDOW + 1))):
                stored = [pool[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(first, len(tokens))]
                assert stored == tokens[first:]

    @invariant()
    def the_sliding_group_holds_at_most_the_window_bound(self) -> None:
        bound = sliding_blocks_per_sequence(WINDOW, 3 * BLOCK_SIZE, BLOCK_SIZE)  # a prompt is the largest write
        for request_id in self.tokens:
            held = [b for b in self.manager.groups[1].block_tables[request_id] if b != RELEASED]
            assert len(held) <= bound

    @invariant()
    def the_cache_finds_blocks_that_hold_the_prefix(self) -> None:
        for request_id, tokens in self.tokens.items():
            full, sliding = self.manager.find_cached_prefix([*tokens, 0], self.salts[request_id])
            for index, block in enumerate(full):
                assert self.pools[0][block] == tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            for index, block in enumerate(sliding):
                if block != RELEASED:
                    assert self.pools[1][block] == tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            # The sliding blocks found cover the window before the hit.
            first = max(0, (len(full) * BLOCK_SIZE - WINDOW + 1) // BLOCK_SIZE)
            assert all(block != RELEASED for block in sliding[first:])

    def teardown(self) -> None:
        for request_id in list(self.tokens):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self._free_counts() == [FULL_BLOCKS, SLIDING_BLOCKS]


TestHybridBlockManager = HybridBlockManagerMachine.TestCase
TestHybridBlockManager.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_groups_by_attention_kind():
    """One group where the layers are all one kind (Llama; Mistral's window on every layer); a
    full-attention group first, then one per window, where they mix (Gemma 2 / 3)."""
    assert kv_group_windows([None, None]) == [None] and layer_kv_groups([None, None]) == [0, 0]
    assert kv_group_windows([8, 8]) == [8] and layer_kv_groups([8, 8]) == [0, 0]
    assert kv_group_windows([4, None, 4]) == [None, 4] and layer_kv_groups([4, None, 4]) == [1, 0, 1]
    assert layer_kv_groups([4] * 5 + [None]) == [1] * 5 + [0]


def test_a_hit_stops_before_an_evicted_block_inside_the_window():
    """A prefix whose sliding blocks inside the window before the hit were evicted is shortened to
    where the window's blocks are all there (vLLM's sliding-window lookup)."""
    manager = KVCacheCoordinator([KVCacheManager(16, BLOCK_SIZE), SlidingWindowManager(16, BLOCK_SIZE, WINDOW, group=1)])
    prompt = list(range(4 * BLOCK_SIZE + 1))
    assert manager.allocate_slots(0, 0, len(prompt))
    manager.cache_computed_blocks(0, prompt, len(prompt))
    manager.free(0)
    full, sliding = manager.find_cached_prefix(prompt)
    # Position 16 sees keys 12-16 (a window of 5): of the sliding group only block 3 is needed.
    assert len(full) == 4 and sliding[:3] == [RELEASED] * 3 and sliding[3] != RELEASED
    # Forget the sliding group's block 3 (as an eviction would): the hit shrinks to 3 blocks,
    # whose next position (12) sees keys 8-12: block 2.
    sliding_group = manager.groups[1]
    key = sliding_group.pool.keys[sliding[3]]
    del sliding_group.pool.cached[key]
    sliding_group.pool.keys[sliding[3]] = None
    sliding_group.pool._open[sliding[3]] = True
    full, sliding = manager.find_cached_prefix(prompt)
    assert len(full) == len(sliding) == 3 and sliding[:2] == [RELEASED] * 2 and sliding[2] != RELEASED
    manager.check_invariants()
