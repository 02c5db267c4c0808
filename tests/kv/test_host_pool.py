"""HostBlockPool: exact block ids, LRU eviction order, leases never evicted, the timeout backstop."""

from __future__ import annotations

import random

import pytest

from glmserve.kv.block_pool import IntegrityError
from glmserve.kv.host_pool import HostBlockPool


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def stored_pool(n: int, k: int) -> HostBlockPool:
    pool = HostBlockPool(n, lease_timeout_s=10.0)
    lease = pool.begin_write([h(i) for i in range(k)], now=0.0)
    assert lease.block_ids == list(range(k))
    assert pool.commit_write(lease.lease_id) == [h(i) for i in range(k)]
    pool.check_integrity()
    return pool


def test_write_is_invisible_until_commit_and_dedups() -> None:
    pool = HostBlockPool(4)
    lease = pool.begin_write([h(0), h(1), h(0)], now=0.0)
    assert (lease.hashes, lease.block_ids) == ([h(0), h(1)], [0, 1])
    assert pool.match([h(0)]) == 0  # bytes still landing
    assert pool.begin_write([h(1), h(2)], now=0.0).block_ids == [2]  # h(1) is being written
    pool.commit_write(lease.lease_id)
    assert pool.match([h(0), h(1), h(2)]) == 2
    assert pool.begin_write([h(0)], now=0.0).block_ids == []  # stored: nothing to write
    pool.check_integrity()


def test_lru_eviction_order_and_touch_on_write_and_read() -> None:
    pool = stored_pool(4, 4)  # LRU: 0 1 2 3
    read = pool.begin_read([h(0)], now=0.0)
    pool.end_read(read.lease_id)  # 0 becomes most recently used: 1 2 3 0
    pool.begin_write([h(1)], now=0.0)  # already stored: touched -> 2 3 0 1
    lease = pool.begin_write([h(10), h(11)], now=0.0)
    assert lease.block_ids == [2, 3] and lease.evicted == [h(2), h(3)]
    assert pool.evictions == 2
    assert pool.match([h(0), h(1)]) == 2 and not pool.contains(h(2))
    pool.check_integrity()


def test_eviction_never_touches_blocks_being_read_or_written() -> None:
    pool = stored_pool(4, 3)  # block 3 free
    read = pool.begin_read([h(0), h(1)], now=0.0)  # pins 0 and 1
    writing = pool.begin_write([h(5)], now=0.0)  # takes free block 3
    assert writing.block_ids == [3]
    lease = pool.begin_write([h(6), h(7), h(8)], now=0.0)  # only block 2 is evictable
    assert (lease.block_ids, lease.hashes, lease.evicted) == ([2], [h(6)], [h(2)])
    assert pool.num_free == 0 and pool.num_pinned == 4
    assert pool.begin_write([h(9)], now=0.0).block_ids == []  # everything pinned: nothing evicted
    pool.end_read(read.lease_id)
    pool.abort_write(writing.lease_id)
    assert pool.begin_write([h(9)], now=0.0).block_ids == [3]  # the aborted block came back first
    pool.check_integrity()


def test_read_pins_leading_run_only() -> None:
    pool = stored_pool(4, 3)
    lease = pool.begin_read([h(0), h(1), h(7), h(2)], now=0.0)
    assert (lease.hashes, lease.block_ids) == ([h(0), h(1)], [0, 1])
    assert pool.begin_read([h(7)], now=0.0).block_ids == []


def test_expire_ends_leases_past_their_deadline() -> None:
    pool = stored_pool(3, 2)
    read = pool.begin_read([h(0)], now=0.0)
    write = pool.begin_write([h(5)], now=5.0)
    assert pool.expire(9.0).reads == [] and pool.num_pinned == 2
    expired = pool.expire(10.0)
    assert (expired.reads, expired.writes) == ([read.lease_id], [])
    expired = pool.expire(15.0)
    assert expired.writes == [write.lease_id] and pool.num_pinned == 0
    with pytest.raises(KeyError):
        pool.commit_write(write.lease_id)  # a late commit of an expired write is refused
    assert not pool.contains(h(5))
    pool.check_integrity()


def test_layersplit_parts_store_a_block_once_every_stage_wrote_its_slice() -> None:
    pool = HostBlockPool(4, lease_timeout_s=10.0)
    s0 = pool.begin_write([h(0), h(1)], now=0.0, part=(0, 2))
    s1 = pool.begin_write([h(1), h(0), h(2)], now=1.0, part=(1, 2))  # joins the blocks stage 0 reserved
    assert (s1.hashes, s1.block_ids) == ([h(1), h(0), h(2)], [1, 0, 2])
    assert pool.begin_write([h(0)], now=1.0, part=(1, 2)).block_ids == []  # stage 1 already writes it
    assert pool.begin_write([h(0)], now=1.0).block_ids == []  # a whole-block writer leaves it alone
    assert pool.commit_write(s0.lease_id) == []  # stage 1's slices are still missing
    assert pool.match([h(0)]) == 0
    assert pool.commit_write(s1.lease_id) == [h(1), h(0)]  # h(2) waits for stage 0
    assert pool.match([h(0), h(1), h(2)]) == 2
    pool.check_integrity()
    late = pool.begin_write([h(2)], now=2.0, part=(0, 2))
    assert late.block_ids == [2] and pool.commit_write(late.lease_id) == [h(2)]
    # A block some stages committed waits for the rest until its deadline, then is freed.
    s1 = pool.begin_write([h(3)], now=3.0, part=(1, 2))
    pool.commit_write(s1.lease_id)
    pool.expire(12.9)
    assert pool.num_pinned == 1
    pool.expire(13.0)
    assert pool.num_pinned == 0 and not pool.contains(h(3))
    # A part given back before any part landed frees its block at once.
    s0 = pool.begin_write([h(3)], now=14.0, part=(0, 2))
    pool.abort_write(s0.lease_id)
    assert pool.num_pinned == 0
    pool.check_integrity()
    with pytest.raises(ValueError, match="part"):
        pool.begin_write([h(4)], now=0.0, part=(2, 2))


def test_integrity_check_catches_corruption() -> None:
    pool = stored_pool(3, 2)
    pool._free.append(0)  # a stored block also on the free list
    with pytest.raises(IntegrityError):
        pool.check_integrity()


def test_random_operations_keep_integrity() -> None:
    rng = random.Random(7)
    pool = HostBlockPool(8, lease_timeout_s=3.0)
    reads, writes = [], []
    for step in range(2000):
        now = float(step)
        op = rng.randrange(5)
        if op == 0:
            part = rng.choice([None, (0, 2), (1, 2)])  # whole blocks, or a LayerSplit stage's slices
            writes.append(pool.begin_write([h(rng.randrange(20)) for _ in range(3)], now, part).lease_id)
        elif op == 1 and writes:
            lease_id = writes.pop(rng.randrange(len(writes)))
            if lease_id in pool._writes:
                (pool.commit_write if rng.random() < 0.8 else pool.abort_write)(lease_id)
        elif op == 2:
            reads.append(pool.begin_read([h(rng.randrange(20)) for _ in range(2)], now).lease_id)
        elif op == 3 and reads:
            lease_id = reads.pop(rng.randrange(len(reads)))
            if lease_id in pool._reads:
                pool.end_read(lease_id)
        else:
            pool.expire(now)
        pool.check_integrity()
