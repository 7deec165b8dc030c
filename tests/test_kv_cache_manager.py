"""Property test of the block manager: random allocate (with prefix-cache lookups) / append /
fork / free / end-of-step sequences.

Besides the bookkeeping invariants, a shadow KV pool records which token each slot holds; after
every operation each request's block table must read back exactly its own tokens. That is what
copy-on-write has to guarantee for forked requests, and what the prefix cache has to guarantee for
blocks it hands out (a block reused with a stale key would read back someone else's tokens).
Tokens come from a two-letter alphabet so that prompts share prefixes often; blocks are cached
only at `end_step`, so two requests can compute the same new prefix in one step. Requests carry one
of a few cache salts (or none), as tenants would.
"""

import hashlib
import itertools
import struct

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from kv_cache_machine import RequestLifecycleMachine

from roseinfer.core.kv_cache_manager import KVCacheManager

NUM_BLOCKS = 12
BLOCK_SIZE = 4
TOKENS = st.integers(0, 1)
SALTS = st.sampled_from([None, "a", "b"])


class BlockManagerMachine(RequestLifecycleMachine):
    span: int | None = None  # every layer's sliding window (None: full attention)

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, attention_span=self.span)
        self.pool: dict[int, list[int | None]] = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.tokens: dict[int, list[int]] = {}  # what each live request has written
        self.salts: dict[int, str | None] = {}
        self.ids = itertools.count()

    def _write(self, request_id: int, new_tokens: list[int], cached: list[int] = ()) -> bool:
        start = len(self.tokens[request_id])
        if not self.manager.allocate_slots(request_id, start, len(new_tokens), cached):
            return False
        for copy in self.manager.take_pending_copies():
            self.pool[copy.dst] = list(self.pool[copy.src])
        table = self.manager.block_table(request_id)
        for position, value in enumerate(new_tokens, start):
            self.pool[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = value
            self.tokens[request_id].append(value)
        return True

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=3 * BLOCK_SIZE), salt=SALTS)
    def allocate(self, prompt: list[int], salt: str | None) -> None:
        request_id = next(self.ids)
        cached = self.manager.find_cached_prefix(prompt, salt)
        num_cached = len(cached) * BLOCK_SIZE
        assert num_cached < len(prompt), "the last token must always be computed"
        event("prefix cache hit" if cached else "prefix cache miss")
        free_before = self.manager.num_free_blocks
        self.tokens[request_id] = list(prompt[:num_cached])
        self.salts[request_id] = salt
        taken = cached[self._num_released(num_cached):]  # cached blocks before the window are not taken
        fits = -(-len(prompt) // BLOCK_SIZE) - len(cached) <= self.manager.pool.num_free_after_taking(taken)
        assert self._write(request_id, prompt[num_cached:], cached) == fits
        if not fits:
            del self.tokens[request_id], self.salts[request_id]
            assert request_id not in self.manager.block_tables
            assert self.manager.num_free_blocks == free_before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tail=st.lists(TOKENS, max_size=BLOCK_SIZE + 2), salt=SALTS)
    def allocate_with_a_shared_prefix(self, data, tail: list[int], salt: str | None) -> None:
        """A prompt that starts like a live request's tokens (a system prompt, a retried chat)."""
        source = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
        prefix = source[: data.draw(st.integers(0, len(source)))]
        if prefix or tail:
            self.allocate(prefix + tail, salt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, min_size=1, max_size=BLOCK_SIZE + 2))
    def append(self, data, new_tokens: list[int]) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.tokens)))
        table_before = list(self.manager.block_table(request_id))
        free_before = self.manager.num_free_blocks
        if not self._write(request_id, new_tokens):
            # A failed allocation changes nothing but releasing the blocks before the window.
            released = self._num_released(len(self.tokens[request_id]))
            assert self.manager.block_table(request_id)[released:] == table_before[released:]
            assert self.manager.num_free_blocks == free_before + self._newly_released(table_before, released)

    def _num_released(self, num_computed: int) -> int:
        """Leading blocks no query at position >= num_computed reads (none without a window)."""
        return 0 if self.span is None else max(0, (num_computed - self.span + 1) // BLOCK_SIZE)

    def _newly_released(self, table: list[int], released: int) -> int:
        """Blocks of `table[:released]` that the release returns to the free queue."""
        counts = self.manager.pool.ref_counts
        return sum(1 for block in set(table[:released]) if block >= 0 and counts[block] == 0)

    @invariant()
    def every_request_reads_back_its_tokens(self) -> None:
        """...every token the next query can see: with a window, those of its last `span` positions."""
        for request_id, tokens in self.tokens.items():
            table = self.manager.block_table(request_id)
            assert len(table) == -(-len(tokens) // BLOCK_SIZE)
            first = 0 if self.span is None else max(0, len(tokens) - self.span + 1)
            stored = [self.pool[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(first, len(tokens))]
            assert stored == tokens[first:]

    @invariant()
    def the_cache_finds_blocks_that_hold_the_prefix(self) -> None:
        for request_id, tokens in self.tokens.items():
            found = self.manager.find_cached_prefix([*tokens, 0], self.salts[request_id])
            for index, block in enumerate(found):
                assert self.pool[block] == tokens[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]

    def teardown(self) -> None:
        for request_id in list(self.tokens):
            self.manager.free(request_id)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == NUM_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The same with a sliding window on every layer: blocks before it are released."""

    span = 5


TestWindowedBlockManager = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManager.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


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


def test_requests_decoding_together_keep_their_blocks_adjacent():
    """8 requests prefilled one after another, then growing a token per step together: each one's
    blocks stay a run of consecutive ids (memory the decode kernel streams through); handed out in
    queue order they interleaved (request r's j-th block was 8 j + r)."""
    manager = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False, max_num_seqs=16)
    lengths = dict.fromkeys(range(8), 10)
    for request_id, length in lengths.items():
        assert manager.allocate_slots(request_id, 0, length)
    for _ in range(40):
        for request_id in lengths:
            assert manager.allocate_slots(request_id, lengths[request_id], 1)
            lengths[request_id] += 1
    for request_id in lengths:
        table = manager.block_table(request_id)
        assert len(table) == 13 and table == list(range(table[0], table[0] + 13)), table
    manager.check_invariants()


def test_a_freed_cached_block_is_evicted_only_when_no_uncached_block_is_free():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    assert manager.allocate_slots(0, 0, 4)  # two full blocks
    manager.cache_computed_blocks(0, [1, 2, 3, 4], 4)
    cached = manager.block_table(0)
    manager.free(0)
    assert manager.allocate_slots(1, 0, 4)  # the two never-used blocks, not the cached ones
    assert set(manager.block_table(1)).isdisjoint(cached)
    assert manager.find_cached_prefix([1, 2, 3, 4, 5]) == cached
    assert manager.allocate_slots(2, 0, 1)  # now one cached block must go
    assert len(manager.find_cached_prefix([1, 2, 3, 4, 5])) < 2
    manager.check_invariants()


def test_lanes_are_reused_lowest_first():
    """A request that follows a finished one starts in the lowest free lane: the pool's memory in
    use stays at the front instead of creeping over the whole (lazily committed) pool."""
    manager = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False, max_num_seqs=4)
    for request_id in range(3):
        assert manager.allocate_slots(request_id, 0, 8)
    assert [manager.block_table(r) for r in range(3)] == [[0, 1], [16, 17], [32, 33]]
    manager.free(1)
    assert manager.allocate_slots(3, 0, 8)
    assert manager.block_table(3) == [16, 17]
    manager.check_invariants()


def test_block_keys_are_sha256_chained_from_the_salt():
    """The documented chain, recomputed here with hashlib: no Python hash() anywhere (whose 64
    bits a crafted prompt can collide with another tenant's prefix, vLLM's CVE-2025-25183)."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    for request_id, salt, root in [(0, None, bytes(32)),
                                   (1, "tenant", hashlib.sha256(b"cache_salt\0tenant").digest())]:
        assert manager.allocate_slots(request_id, 0, 9)
        manager.cache_computed_blocks(request_id, list(range(1, 10)), 9, salt)
        first = hashlib.sha256(root + struct.pack("<4q", 1, 2, 3, 4)).digest()
        second = hashlib.sha256(first + struct.pack("<4q", 5, 6, 7, 8)).digest()
        table = manager.block_table(request_id)
        assert (manager.pool.cached[first], manager.pool.cached[second]) == (table[0], table[1])
    assert len(manager.pool.cached) == 4
    manager.check_invariants()


def test_a_salt_shares_cached_blocks_only_with_the_same_salt():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    assert manager.allocate_slots(0, 0, 9)
    manager.cache_computed_blocks(0, prompt, 9, "tenant-a")
    cached = manager.block_table(0)[:2]
    manager.free(0)
    assert manager.find_cached_prefix(prompt, "tenant-a") == cached
    assert manager.find_cached_prefix(prompt, "tenant-b") == []
    assert manager.find_cached_prefix(prompt) == []  # nor with requests that send no salt
    assert manager.allocate_slots(1, 0, 9)
    manager.cache_computed_blocks(1, prompt, 9)
    assert manager.find_cached_prefix(prompt) == manager.block_table(1)[:2]
    assert manager.find_cached_prefix(prompt, "tenant-a") == cached
