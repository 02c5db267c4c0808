"""BlockPool listeners see exactly the hashes that enter and leave the prefix-cache map."""

from __future__ import annotations

from glmserve.kv.block_pool import BlockPool


def h(i: int) -> bytes:
    return bytes([i + 1]) * 4


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []

    def block_stored(self, block_hash: bytes) -> None:
        self.log.append(("stored", block_hash))

    def block_removed(self, block_hash: bytes) -> None:
        self.log.append(("removed", block_hash))


def test_commit_and_eviction_report_exact_events() -> None:
    pool, events = BlockPool(3), Events()
    pool.add_listener(events)
    a, b, c = pool.allocate(3)
    assert pool.commit(a, h(0)) and pool.commit(b, h(1))
    assert pool.commit(a, h(0))  # the same hash again: already known, no event
    assert not pool.commit(c, h(1))  # another block holds h(1): not cached, no event
    assert events.log == [("stored", h(0)), ("stored", h(1))]
    pool.release([c, b, a])  # c returns to the free list, b and a become cached-free (b first)
    events.log.clear()
    pool.allocate(1)  # the free block c: nothing leaves the cache
    assert events.log == []
    pool.allocate(2)  # evicts b then a (LRU order)
    assert events.log == [("removed", h(1)), ("removed", h(0))]
    pool.check_integrity()


def test_a_reused_cached_block_is_not_reported_again() -> None:
    pool, events = BlockPool(2), Events()
    pool.add_listener(events)
    (a,) = pool.allocate(1)
    pool.commit(a, h(0))
    pool.release([a])
    hits = pool.lookup([h(0)])
    pool.acquire(hits)  # a prefix hit moves the block out of the LRU; the map keeps the hash
    assert events.log == [("stored", h(0))]
    assert pool.allocate(1) != [a]


def test_every_listener_is_told() -> None:
    pool, first, second = BlockPool(1), Events(), Events()
    pool.add_listener(first)
    pool.add_listener(second)
    (a,) = pool.allocate(1)
    pool.commit(a, h(5))
    assert first.log == second.log == [("stored", h(5))]
