"""BlockPool: exact allocation and eviction order, ref counting, prefix lookup, a model-based property test."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from glmserve.kv.block_pool import BlockPool, IntegrityError, OutOfBlocks


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


class Recorder:
    """An on_evict callback that remembers what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[int, bytes]] = []

    def __call__(self, block_id: int, block_hash: bytes) -> None:
        self.events.append((block_id, block_hash))


def cached_pool(n: int, committed: int, evict: Recorder | None = None) -> tuple[BlockPool, list[int]]:
    """A pool whose first `committed` blocks held one request's prompt, released in reverse order."""
    pool = BlockPool(n, on_evict=evict)
    ids = pool.allocate(committed)
    for i, block_id in enumerate(ids):
        assert pool.commit(block_id, h(i))
    pool.release(ids[::-1])
    pool.check_integrity()
    return pool, ids


def test_allocation_order_and_free_list_fifo() -> None:
    pool = BlockPool(6)
    assert (pool.num_free, pool.num_used, pool.num_cached) == (6, 0, 0)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(0) == []
    assert (pool.num_free, pool.num_used) == (1, 5)
    pool.release([1, 0])  # unhashed: back to the tail of the free list, in release order
    assert pool.allocate(3) == [5, 1, 0]
    assert all(pool.ref_count(b) == 1 for b in range(6))
    pool.check_integrity()


def test_release_to_zero_makes_hashed_blocks_cached_free() -> None:
    pool, ids = cached_pool(6, 3)
    assert ids == [0, 1, 2]
    assert (pool.num_free, pool.num_used, pool.num_cached) == (6, 0, 3)
    assert pool.lookup([h(0), h(1), h(2)]) == [0, 1, 2]
    assert [pool.block_hash(b) for b in range(4)] == [h(0), h(1), h(2), None]
    pool.check_integrity()


def test_free_blocks_are_used_before_cached_ones() -> None:
    evicted = Recorder()
    pool, _ = cached_pool(5, 3, evicted)
    assert pool.allocate(2) == [3, 4]
    assert evicted.events == []
    assert pool.num_cached == 3
    pool.check_integrity()


def test_lru_eviction_order_tail_blocks_first() -> None:
    evicted = Recorder()
    pool, _ = cached_pool(4, 4, evicted)  # released [3, 2, 1, 0]: block 3 is least recently used
    assert pool.allocate(1) == [3]
    assert evicted.events == [(3, h(3))]
    assert pool.block_hash(3) is None and pool.num_cached == 3
    assert pool.lookup([h(0), h(1), h(2), h(3)]) == [0, 1, 2]  # the prefix survives
    assert pool.allocate(2) == [2, 1]
    assert evicted.events == [(3, h(3)), (2, h(2)), (1, h(1))]
    assert pool.lookup([h(0), h(1)]) == [0]
    pool.check_integrity()


def test_acquire_takes_block_out_of_lru_and_release_makes_it_most_recent() -> None:
    evicted = Recorder()
    pool, _ = cached_pool(4, 4, evicted)  # LRU: 3, 2, 1, 0
    hit = pool.lookup([h(0), h(1)])
    assert hit == [0, 1]
    pool.acquire(hit)
    assert (pool.num_free, pool.num_used) == (2, 2)
    assert pool.ref_count(0) == pool.ref_count(1) == 1
    assert pool.allocate(2) == [3, 2]  # the acquired blocks are not evictable
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.release([1, 0])
    pool.release([2, 3])  # never committed after reallocation: plain free
    assert pool.allocate(3) == [2, 3, 1]  # free list first, then the LRU head
    assert evicted.events[-1] == (1, h(1))
    pool.check_integrity()


def test_lookup_stops_at_first_miss_and_changes_nothing() -> None:
    pool, _ = cached_pool(6, 4)
    assert pool.lookup([h(0), h(9), h(2), h(3)]) == [0]
    assert pool.lookup([h(9), h(0)]) == []
    assert pool.lookup([]) == []
    assert pool.lookup([h(1), h(2)]) == [1, 2]  # any present run, not only from the chain's start
    assert all(pool.ref_count(b) == 0 for b in range(6))
    assert (pool.num_free, pool.num_used, pool.num_cached) == (6, 0, 4)
    pool.check_integrity()


def test_double_release_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.release([ids[0]])
    with pytest.raises(ValueError, match="block 0 released more often"):
        pool.release([ids[0]])
    with pytest.raises(ValueError, match="block 1 released more often"):
        pool.release([ids[1], ids[1]])  # the second drop would go below zero: neither happens
    assert pool.ref_count(1) == 1
    pool.check_integrity()
    pool.release([1])
    assert pool.allocate(4) == [2, 3, 0, 1]
    pool.check_integrity()


def _drain(pool: BlockPool) -> list[int]:
    return pool.allocate(pool.num_free)


def test_allocate_failure_leaves_state_unchanged() -> None:
    evicted, evicted_ref = Recorder(), Recorder()
    pools = [cached_pool(6, 3, evicted)[0], cached_pool(6, 3, evicted_ref)[0]]
    for pool in pools:
        pool.allocate(1)
    with pytest.raises(OutOfBlocks) as err:
        pools[0].allocate(6)
    assert (err.value.requested, err.value.available) == (6, 5)
    assert evicted.events == []
    pools[0].check_integrity()
    assert (pools[0].num_free, pools[0].num_used, pools[0].num_cached) == (5, 1, 3)
    assert pools[0].lookup([h(0), h(1), h(2)]) == [0, 1, 2]
    # The failed pool behaves exactly like one that never saw the failure.
    assert _drain(pools[0]) == _drain(pools[1]) == [4, 5, 2, 1, 0]
    assert evicted.events == evicted_ref.events == [(2, h(2)), (1, h(1)), (0, h(0))]


def test_eviction_callback_sees_a_consistent_pool() -> None:
    seen: list[tuple[int, bytes, list[int]]] = []

    def on_evict(block_id: int, block_hash: bytes) -> None:
        pool.check_integrity()
        seen.append((block_id, block_hash, pool.lookup([block_hash])))

    pool = BlockPool(2, on_evict=on_evict)
    ids = pool.allocate(2)
    pool.commit(ids[0], h(0))
    pool.commit(ids[1], h(1))
    pool.release(ids[::-1])
    assert pool.allocate(2) == [1, 0]
    assert seen == [(1, h(1), []), (0, h(0), [])]
    pool.check_integrity()


def test_commit_duplicate_hash_keeps_existing_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.commit(a, h(0)) is True
    assert pool.commit(a, h(0)) is True  # idempotent on the holder
    assert pool.commit(b, h(0)) is False  # computed twice (e.g. two racing requests)
    assert pool.block_hash(b) is None and pool.lookup([h(0)]) == [a]
    pool.release([b, a])
    assert pool.num_cached == 1
    assert pool.allocate(3) == [2, 3, b]  # b was plain free, a stays cached
    assert pool.lookup([h(0)]) == [a]
    pool.check_integrity()


def test_commit_errors() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.commit(a, h(0))
    with pytest.raises(ValueError, match="different hash"):
        pool.commit(a, h(1))
    with pytest.raises(ValueError, match="block_id: block 2 has no owner"):
        pool.commit(2, h(2))
    with pytest.raises(ValueError, match="block_hash"):
        pool.commit(a, b"")
    with pytest.raises(ValueError, match="block_hash"):
        pool.commit(a, "hash-0")  # type: ignore[arg-type]
    pool.release([a])
    with pytest.raises(ValueError, match="no owner"):
        pool.commit(a, h(0))  # cached-free: acquire it first
    pool.check_integrity()


def test_acquire_and_id_validation_change_nothing() -> None:
    pool, _ = cached_pool(4, 2)
    with pytest.raises(ValueError, match="block 3 is free"):
        pool.acquire([0, 3])
    assert pool.ref_count(0) == 0 and pool.num_free == 4
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ValueError, match="block_id"):
            pool.acquire([bad])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="block_id"):
            pool.release([bad])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="block_id"):
            pool.ref_count(bad)  # type: ignore[arg-type]
    for n in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n:"):
            pool.allocate(n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1)
    pool.check_integrity()


def test_shared_owners_keep_block_until_last_release() -> None:
    """A transfer owning a block alongside its request: freed only when both are done."""
    pool = BlockPool(2)
    request = pool.allocate(2)
    pool.acquire(request)  # the transfer
    pool.acquire([request[0]])  # repeats count
    assert [pool.ref_count(b) for b in request] == [3, 2]
    pool.release(request[::-1])  # the request ends first
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.release(request[::-1])
    pool.release([request[0]])
    assert pool.num_free == 2 and pool.num_used == 0
    pool.check_integrity()


def test_empty_pool() -> None:
    pool = BlockPool(0)
    assert pool.allocate(0) == []
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    pool, _ = cached_pool(4, 2)
    pool._ref[0] = 1  # a cached-free block with an owner
    with pytest.raises(IntegrityError, match="block 0 in cached-free has ref count 1"):
        pool.check_integrity()
    pool, _ = cached_pool(4, 2)
    pool._cached[h(7)] = 3
    with pytest.raises(IntegrityError, match="cache map points"):
        pool.check_integrity()
    pool = BlockPool(3)
    pool._free.append(0)
    with pytest.raises(IntegrityError, match="block 0 is in free and in free"):
        pool.check_integrity()
    assert issubclass(IntegrityError, AssertionError)


# -- model-based property test ------------------------------------------------------------------------

NUM_BLOCKS = 8


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / commit / lookup+acquire / release against a list-based reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.evicted = Recorder()
        self.pool = BlockPool(NUM_BLOCKS, on_evict=self.evicted)
        self.free = list(range(NUM_BLOCKS))
        self.lru: list[int] = []
        self.ref = [0] * NUM_BLOCKS
        self.hash: list[bytes | None] = [None] * NUM_BLOCKS
        self.owners: list[list[int]] = []  # each owner holds one reference to each of its blocks

    def _map(self) -> dict[bytes, int]:
        return {hh: b for b, hh in enumerate(self.hash) if hh is not None}

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.free) + len(self.lru):
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n)
            return
        expected, evictions = [], []
        for _ in range(n):
            b = self.free.pop(0) if self.free else self.lru.pop(0)
            if self.hash[b] is not None:
                evictions.append((b, self.hash[b]))
                self.hash[b] = None
            self.ref[b] = 1
            expected.append(b)
        before = len(self.evicted.events)
        assert self.pool.allocate(n) == expected
        assert self.evicted.events[before:] == evictions
        if expected:
            self.owners.append(expected)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), key=st.integers(0, 5))
    def commit(self, data: st.DataObject, key: int) -> None:
        owner = data.draw(st.sampled_from(self.owners))
        b = data.draw(st.sampled_from(owner))
        current = self.hash[b]
        if current is not None and current != h(key):
            with pytest.raises(ValueError):
                self.pool.commit(b, h(key))
            return
        added = current == h(key) or h(key) not in self._map()
        assert self.pool.commit(b, h(key)) is added
        if added:
            self.hash[b] = h(key)

    @rule(keys=st.lists(st.integers(0, 5), max_size=4))
    def lookup_and_acquire(self, keys: list[int]) -> None:
        cache = self._map()
        expected = []
        for k in keys:
            if h(k) not in cache:
                break
            expected.append(cache[h(k)])
        assert self.pool.lookup([h(k) for k in keys]) == expected
        if not expected:
            return
        self.pool.acquire(expected)
        for b in expected:
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1
        self.owners.append(expected)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        owner = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.pool.release(owner[::-1])
        for b in owner[::-1]:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (self.free if self.hash[b] is None else self.lru).append(b)

    @precondition(lambda self: any(r == 0 for r in self.ref))
    @rule(data=st.data())
    def over_release_is_refused(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from([b for b, r in enumerate(self.ref) if r == 0]))
        with pytest.raises(ValueError):
            self.pool.release([b])

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_integrity()
        assert [self.pool.ref_count(b) for b in range(NUM_BLOCKS)] == self.ref
        assert [self.pool.block_hash(b) for b in range(NUM_BLOCKS)] == self.hash
        assert self.pool.num_free == len(self.free) + len(self.lru)
        assert self.pool.num_used == sum(r > 0 for r in self.ref)
        assert self.pool.num_cached == len(self._map())

    def teardown(self) -> None:
        for owner in self.owners:
            self.pool.release(owner[::-1])
        self.pool.check_integrity()
        assert self.pool.num_used == 0 and self.pool.num_free == NUM_BLOCKS


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,  # no .hypothesis/ in the repo
)
test_pool_matches_reference_model = PoolMachine.TestCase
