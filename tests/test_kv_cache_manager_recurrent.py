"""Property test of the KV coordinator (core/kv_cache/coordinator.py) over a hybrid model with
recurrent layers (Qwen3.5: full-attention layers and Gated DeltaNet layers): a full-attention group
and a recurrent-state group with two snapshot slots for the prefix cache, both small enough to run
out, under random allocate (from the longest prefix hit) / append / free / end-of-step sequences
(no forks: a state cannot be shared).

A shadow pool records which token each full-group slot holds, and a shadow state pool which tokens
each state slot has taken in (the runner's copies applied: snapshots restored before a step, saved
after it). After every operation each request's full table reads back its tokens, its recurrent
table is one slot no other live request holds, a prefix hit's snapshot holds exactly the hit's
tokens (never a wrong state), an allocation that fails in either group changes neither, and when
all requests have ended every slot and block is free and every snapshot slot is free or cached.
"""

import itertools
import logging

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from kv_cache_machine import RequestLifecycleMachine

from roseinfer.common.kv_cache_spec import KVCacheGroupSpec, group_pool_sizes, kv_cache_groups
from roseinfer.core.kv_cache import (
    BlockCopy,
    KVCacheCoordinator,
    KVCacheManager,
    RecurrentStateManager,
)

FULL_BLOCKS = 12
SLOTS = 3
SNAPSHOTS = 2
BLOCK_SIZE = 4
TOKENS = st.integers(0, 1)


class RecurrentCoordinatorMachine(RequestLifecycleMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheCoordinator([
            KVCacheManager(FULL_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True),
            RecurrentStateManager(SLOTS, group=1, num_snapshots=SNAPSHOTS),
        ])
        self.states: dict[int, tuple[int, ...]] = {}  # state slot -> the tokens its state has taken in
        self.prompt_lengths: dict[int, int] = {}
        self.pool = {b: [None] * BLOCK_SIZE for b in range(FULL_BLOCKS)}
        self.tokens: dict[int, list[int]] = {}
        self.salts: dict[int, str | None] = {}
        self.ids = itertools.count()

    def _write(self, request_id: int, new_tokens: list[int], cached: list[list[int]] = ()) -> bool:
        start = len(self.tokens[request_id])
        if not self.manager.allocate_slots(request_id, start, len(new_tokens), cached,
                                           self.prompt_lengths[request_id]):
            return False
        for copy in self.manager.take_pending_copies():  # before the step: snapshots into new slots
            assert copy.group == 1, "nothing is shared in the full group: nothing to copy"
            self.states[copy.dst] = self.states[copy.src]
        full, (slot,) = self.manager.block_table(request_id)
        if start:  # the state goes on from exactly the tokens before
            assert self.states.get(slot) == tuple(self.tokens[request_id])
        for position, value in enumerate(new_tokens, start):
            self.pool[full[position // BLOCK_SIZE]][position % BLOCK_SIZE] = value
            self.tokens[request_id].append(value)
        self.states[slot] = tuple(self.tokens[request_id])
        for save in self.manager.take_state_saves():  # after the step: states into snapshot slots
            assert save.src == slot and len(self.states[slot]) % BLOCK_SIZE == 0
            self.states[save.dst] = self.states[save.src]
        return True

    def _free_counts(self) -> list[int]:
        return [group.num_free_blocks for group in self.manager.groups]

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=3 * BLOCK_SIZE), chunk=st.integers(1, 2 * BLOCK_SIZE))
    def allocate(self, prompt: list[int], chunk: int) -> None:
        """A prompt starts from its longest hit and computes its first chunk (aligned as the
        scheduler aligns it)."""
        request_id = next(self.ids)
        cached = self.manager.find_cached_prefix(prompt)
        hit = self.manager.cached_tokens(cached)
        if hit:
            event("a prefix hit")
            assert self.states[cached[1][0]] == tuple(prompt[:hit]), "a snapshot of other tokens"
        free_before = self._free_counts()
        self.tokens[request_id], self.salts[request_id] = list(prompt[:hit]), None
        self.prompt_lengths[request_id] = len(prompt)
        num_new = self.manager.align_prefill(hit, min(chunk, len(prompt) - hit), len(prompt))
        fits = -(-(hit + num_new) // BLOCK_SIZE) <= free_before[0] and free_before[1] >= 1
        written = self._write(request_id, prompt[hit : hit + num_new], cached)
        if not hit:
            assert written == fits
        if not written:
            event("an admission ran out of " + ("slots" if free_before[1] == 0 else "blocks"))
            del self.tokens[request_id], self.salts[request_id], self.prompt_lengths[request_id]
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
    def snapshots_hold_their_prefixes(self) -> None:
        state = self.manager.state
        for key, slot in state.snapshots.items():
            tokens = self.states[slot]
            assert len(tokens) % BLOCK_SIZE == 0 and self.manager.groups[0].prefix_keys(
                [*tokens, 0], None, None)[-1] == key

    def teardown(self) -> None:
        for request_id in list(self.tokens):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self._free_counts() == [FULL_BLOCKS, SLOTS]
        state = self.manager.state
        assert not state._pending and len(state.snapshots) + len(state._free_snapshots) == SNAPSHOTS


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


def test_a_prompt_chunk_ending_on_a_block_boundary_keeps_a_snapshot_a_longer_prompt_resumes_from():
    coordinator = KVCacheCoordinator.from_specs(
        [KVCacheGroupSpec("full", (1,)), KVCacheGroupSpec("recurrent", (0,))], [8, 2], BLOCK_SIZE,
        num_state_snapshots=1)
    prompt = list(range(10))
    # A chunk the budget cut at 7 ends at 4; the prompt's last full block (8) ends a chunk of its own.
    assert coordinator.align_prefill(0, 7, len(prompt)) == 4
    assert coordinator.align_prefill(4, 6, len(prompt)) == 4
    assert coordinator.align_prefill(8, 2, len(prompt)) == 2
    assert coordinator.allocate_slots(0, 0, 8, num_prompt_tokens=len(prompt))
    assert coordinator.take_state_saves() == [BlockCopy(src=0, dst=2, group=1)]
    assert coordinator.find_cached_prefix(prompt + [1]) == [[], []], "registered only once its step is done"
    coordinator.cache_computed_blocks(0, prompt, 8)
    assert coordinator.allocate_slots(0, 8, 2, num_prompt_tokens=len(prompt))
    assert coordinator.take_state_saves() == []
    coordinator.free(0)
    cached = coordinator.find_cached_prefix(prompt + [1, 2])
    assert cached[1] == [2] and coordinator.cached_tokens(cached) == 8
    assert coordinator.find_cached_prefix(prompt[:3] + [0] * 9) == [[], []], "another prefix"
    assert coordinator.allocate_slots(1, 8, 4, cached, num_prompt_tokens=12)
    assert coordinator.take_pending_copies() == [BlockCopy(src=2, dst=0, group=1)]
    # Its own prompt's end (12) evicts the one snapshot for a new one once the step is done.
    assert coordinator.take_state_saves() == [BlockCopy(src=0, dst=2, group=1)]
    coordinator.free(1)  # ended before its step was recorded: the snapshot is dropped, not kept
    assert coordinator.find_cached_prefix(prompt + [1, 2, 3]) == [[], []]
    coordinator.check_invariants()
    assert coordinator.state._free_snapshots == [2]
