"""Property test of the block manager: random allocate / append / fork / free sequences.

Besides the bookkeeping invariants, a shadow KV pool records which token each slot holds; after
every operation each request's block table must read back exactly its own tokens, which is what
copy-on-write has to guarantee for forked requests.
"""

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from roseinfer.core.kv_cache_manager import KVCacheManager

NUM_BLOCKS = 12
BLOCK_SIZE = 4


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.pool: dict[int, list[int | None]] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.tokens: dict[int, list[int]] = {}  # what each live request has written
        self.ids = itertools.count()
        self.token_values = itertools.count(1000)

    def _write(self, request_id: int, count: int) -> bool:
        start = len(self.tokens[request_id])
        if not self.manager.allocate_slots(request_id, start, count):
            return False
        for copy in self.manager.take_pending_copies():
            self.pool[copy.dst] = list(self.pool[copy.src])
        table = self.manager.block_table(request_id)
        for position in range(start, start + count):
            value = next(self.token_values)
            self.pool[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = value
            self.tokens[request_id].append(value)
        return True

    @rule(count=st.integers(1, 3 * BLOCK_SIZE))
    def allocate(self, count: int) -> None:
        request_id = next(self.ids)
        free_before = self.manager.num_free_blocks
        self.tokens[request_id] = []
        fits = -(-count // BLOCK_SIZE) <= free_before
        assert self._write(request_id, count) == fits
        if not fits:
            del self.tokens[request_id]
            assert request_id not in self.manager.block_tables
            assert self.manager.num_free_blocks == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, BLOCK_SIZE + 2))
    def append(self, data, count: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        table_before = list(self.manager.block_table(request_id))
        free_before = self.manager.num_free_blocks
        if not self._write(request_id, count):
            # A failed allocation changes nothing.
            assert self.manager.block_table(request_id) == table_before
            assert self.manager.num_free_blocks == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = next(self.ids)
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(request_id)
        del self.tokens[request_id]

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.manager.check_invariants()

    @invariant()
    def every_request_reads_back_its_tokens(self) -> None:
        for request_id, tokens in self.tokens.items():
            table = self.manager.block_table(request_id)
            assert len(table) == -(-len(tokens) // BLOCK_SIZE)
            stored = [self.pool[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(len(tokens))]
            assert stored == tokens

    def teardown(self) -> None:
        for request_id in list(self.tokens):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == NUM_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_copy_on_write_gives_the_writer_a_private_block():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    assert manager.allocate_slots(0, 0, 6)  # blocks [a, b], b half full
    manager.fork(0, 1)
    shared_tail = manager.block_table(0)[1]
    assert manager.pool.ref_counts[shared_tail] == 2
    assert manager.allocate_slots(1, 6, 1)
    (copy,) = manager.take_pending_copies()
    assert copy.src == shared_tail and copy.dst == manager.block_table(1)[1] != shared_tail
    assert manager.block_table(0)[0] == manager.block_table(1)[0]  # the full block stays shared
    assert manager.pool.ref_counts[shared_tail] == 1


def test_allocation_fails_cleanly_when_the_pool_is_exhausted():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    assert manager.allocate_slots(0, 0, 8)
    assert not manager.allocate_slots(1, 0, 1)
    assert 1 not in manager.block_tables
    manager.free(0)
    assert manager.num_free_blocks == 2


def test_pool_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="at least one block"):
        KVCacheManager(num_blocks=0, block_size=16)
