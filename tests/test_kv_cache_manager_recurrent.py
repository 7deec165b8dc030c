"""Property test of the KV coordinator (core/kv_cache/coordinator.py) over a hybrid model with
recurrent layers (Qwen3.5: full-attention layers and Gated DeltaNet layers): a full-attention group
and a recurrent-state group, both small enough to run out, under random allocate / append /
draft-and-roll-back / free / end-of-step sequences (no forks: a state cannot be shared).

A shadow pool records which token each full-group slot holds and which request owns each state
slot: after every operation each request's full table reads back its tokens, its recurrent table is
one slot no other live request holds, the prefix cache finds nothing (a cached prefix would skip
the state's recomputation), an allocation that fails in either group changes neither, and when all
requests have ended every slot and block is free.
"""

import itertools
import logging

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from kv_cache_machine import RequestLifecycleMachine

from roseinfer.common.kv_cache_spec import KVCacheGroupSpec, group_pool_sizes, kv_cache_groups
from roseinfer.core.kv_cache import KVCacheCoordinator, KVCacheManager, RecurrentStateManager

FULL_BLOCKS = 12
SLOTS = 3
BLOCK_SIZE = 4
TOKENS = st.integers(0, 1)


class RecurrentCoordinatorMachine(RequestLifecycleMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheCoordinator([
            KVCacheManager(FULL_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True), RecurrentStateManager(SLOTS, group=1),
        ])
        self.pool = {b: [None] * BLOCK_SIZE for b in range(FULL_BLOCKS)}
        self.tokens: dict[int, list[int]] = {}
        self.salts: dict[int, str | None] = {}
        self.ids = itertools.count()

    def _write(self, request_id: int, new_tokens: list[int]) -> bool:
        start = len(self.tokens[request_id])
        if not self.manager.allocate_slots(request_id, start, len(new_tokens)):
            return False
        assert self.manager.take_pending_copies() == []  # nothing is shared: nothing to copy
        full, _ = self.manager.block_table(request_id)
        for position, value in enumerate(new_tokens, start):
            self.pool[full[position // BLOCK_SIZE]][position % BLOCK_SIZE] = value
            self.tokens[request_id].append(value)
        return True

    def _free_counts(self) -> list[int]:
        return [group.num_free_blocks for group in self.manager.groups]

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=3 * BLOCK_SIZE))
    def allocate(self, prompt: list[int]) -> None:
        request_id = next(self.ids)
        cached = self.manager.find_cached_prefix(prompt)
        assert cached == [[], []] and self.manager.cached_tokens(cached) == 0
        free_before = self._free_counts()
        self.tokens[request_id], self.salts[request_id] = [], None
        fits = -(-len(prompt) // BLOCK_SIZE) <= free_before[0] and free_before[1] >= 1
        assert self._write(request_id, prompt) == fits
        if not fits:
            event("an admission ran out of " + ("slots" if free_before[1] == 0 else "blocks"))
            del self.tokens[request_id], self.salts[request_id]
            assert all(request_id not in group.block_tables for group in self.manager.groups)
            assert self._free_counts() == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, min_size=1, max_size=BLOCK_SIZE + 2))
    def append(self, data, new_tokens: list[int]) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self.manager.block_table(request_id)
        if not self._write(request_id, new_tokens):
            assert self.manager.block_table(request_id) == before
        assert self.manager.block_table(request_id)[1] == before[1]  # the slot stays

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), drafts=st.lists(TOKENS, min_size=1, max_size=4), accepted=st.integers(0, 4))
    def verify_drafts(self, data, drafts: list[int], accepted: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = len(self.tokens[request_id])
        if self._write(request_id, drafts):
            keep = before + min(accepted, len(drafts))
            self.manager.free_tail(request_id, keep)
            del self.tokens[request_id][keep:]

    @invariant()
    def every_request_holds_its_tokens_and_one_slot_of_its_own(self) -> None:
        slots = []
        for request_id, tokens in self.tokens.items():
            full, state = self.manager.block_table(request_id)
            assert len(full) == -(-len(tokens) // BLOCK_SIZE)
            assert [self.pool[full[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(tokens))] == tokens
            assert len(state) == 1 and 0 <= state[0] < SLOTS
            slots.append(state[0])
        assert len(set(slots)) == len(slots)
        assert self.manager.groups[1].num_free_blocks == SLOTS - len(slots)

    @invariant()
    def the_prefix_cache_finds_nothing(self) -> None:
        for tokens in self.tokens.values():
            assert self.manager.find_cached_prefix([*tokens, 0]) == [[], []]

    def teardown(self) -> None:
        for request_id in list(self.tokens):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self._free_counts() == [FULL_BLOCKS, SLOTS]


TestRecurrentCoordinator = RecurrentCoordinatorMachine.TestCase
TestRecurrentCoordinator.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_recurrent_layers_form_a_group_after_the_attention_groups():
    """Qwen3.5's pattern (three linear-attention layers to one full one): the full group, then
    the recurrent one; with sliding layers too, each window's group before it."""
    windows = [None] * 8
    recurrent = [0, 1, 2, 4, 5, 6]
    assert kv_cache_groups(windows, recurrent) == [KVCacheGroupSpec("full", (3, 7)),
                                                   KVCacheGroupSpec("recurrent", tuple(recurrent))]
    assert kv_cache_groups([4, None, 4, None], [3]) == [
        KVCacheGroupSpec("full", (1,)), KVCacheGroupSpec("sliding", (0, 2), 4), KVCacheGroupSpec("recurrent", (3,))]
    groups = kv_cache_groups(windows, recurrent)
    assert group_pool_sizes(groups, 100, None, 8) == [100, 8]


def test_a_model_with_a_recurrent_group_takes_no_prefix_hits_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="roseinfer"):
        coordinator = KVCacheCoordinator.from_specs(
            [KVCacheGroupSpec("full", (1,)), KVCacheGroupSpec("recurrent", (0,))], [8, 2], BLOCK_SIZE)
    assert "recurrent" in caplog.text and not coordinator.enable_prefix_caching and not coordinator.shares_prompts
    prompt = list(range(9))
    assert coordinator.allocate_slots(0, 0, len(prompt))
    coordinator.cache_computed_blocks(0, prompt, len(prompt))
    coordinator.free(0)
    assert coordinator.find_cached_prefix(prompt) == [[], []]
    assert coordinator.allocate_slots(1, 0, 1) and coordinator.allocate_slots(2, 0, 1)
    assert not coordinator.allocate_slots(3, 0, 1), "two slots, two sequences"
    with pytest.raises(RuntimeError, match="cannot be shared"):
        coordinator.fork(1, 4)
    coordinator.check_invariants()
