"""HostOffload over a real BlockPool and cache buffer: who owns which block while host transfers run.

Write-through pins a finished request's committed blocks until the write is done; demotion copies
an evicted block's exact bytes into a staging row before the block is reused; a load pins the
device hits, its destination blocks become prefix-cache hits once committed, and a cancelled load
gives everything back. The pool's integrity check holds after every step.
"""

from __future__ import annotations

import torch

from glmserve.engine.host_offload import HostOffload, HostWrite
from glmserve.kv.block_pool import BlockPool


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def setup(num_blocks: int = 6, staging: int = 2, write_through: bool = True, drops: list | None = None):
    hooks = []
    pool = BlockPool(num_blocks, on_evict=lambda b, bh: hooks[0](b, bh))  # as Engine wires it
    buffer = torch.arange((num_blocks + staging) * 4, dtype=torch.float32).view(num_blocks + staging, 4)
    writes: list[HostWrite] = []
    on_drop = (lambda: drops.append(1)) if drops is not None else None
    host = HostOffload(pool, buffer, staging, write_through=write_through, notify=writes.append, on_drop=on_drop)
    hooks.append(host.on_evict)
    return pool, buffer, host, writes


def cached(pool: BlockPool, k: int, first: int = 0) -> list[int]:
    ids = pool.allocate(k)
    for i, block_id in enumerate(ids):
        pool.commit(block_id, h(first + i))
    return ids


def test_write_through_pins_committed_blocks_until_done() -> None:
    pool, _, host, writes = setup()
    ids = cached(pool, 3) + pool.allocate(1)  # 3 committed blocks and a partial tail
    host.on_free(ids, [h(0), h(1), h(2)])
    pool.release(ids[::-1])  # the request lets go; the write still owns its blocks
    (write,) = writes
    assert (write.rows, write.hashes, write.kind) == (ids[:3], [h(0), h(1), h(2)], "write_through")
    assert [pool.ref_count(b) for b in ids] == [1, 1, 1, 0]
    assert pool.num_free == 3  # the pinned blocks cannot be evicted meanwhile
    host.write_done(write, stored=[h(0), h(1), h(2)])
    assert pool.num_used == 0 and pool.lookup([h(0), h(1), h(2)]) == ids[:3]
    pool.check_integrity()


def test_write_through_off_writes_nothing() -> None:
    pool, _, host, writes = setup(write_through=False)
    ids = cached(pool, 2)
    host.on_free(ids, [h(0), h(1)])
    pool.release(ids[::-1])
    assert writes == [] and pool.num_used == 0


def test_demotion_copies_exact_bytes_before_reuse_and_drops_without_staging() -> None:
    drops: list[int] = []
    pool, buffer, host, writes = setup(num_blocks=4, staging=1, drops=drops)
    ids = cached(pool, 4)
    original = buffer[ids].clone()
    pool.release(ids[::-1])  # LRU: 3 2 1 0 (tail first)
    assert pool.allocate(2) == [3, 2]  # evicts blocks 3 and 2
    (write,) = writes  # one staging row: the first eviction is demoted, the second dropped
    assert (write.rows, write.hashes, write.kind) == ([4], [h(3)], "demotion")
    assert torch.equal(buffer[4], original[3])
    assert host.demotions_dropped == 1 and drops == [1]
    host.write_done(write, stored=[h(3)])
    pool.release([3, 2])
    pool.allocate(4)  # evicts 1 and 0; the staging row is free again
    assert [w.hashes for w in writes[1:]] == [[h(1)]]
    assert torch.equal(buffer[4], original[1])
    pool.check_integrity()


def test_known_host_blocks_are_not_demoted_again() -> None:
    pool, _, host, writes = setup(num_blocks=2, staging=2)
    ids = cached(pool, 2)
    host.on_free(ids, [h(0), h(1)])
    pool.release(ids[::-1])
    host.write_done(writes.pop(), stored=[h(0), h(1)])
    pool.allocate(2)
    assert writes == []  # both evicted blocks are already on the host


def test_load_pins_device_hits_commits_loaded_blocks_and_cancel_frees_all() -> None:
    pool, _, host, _ = setup(num_blocks=8, staging=0)
    device = cached(pool, 2)
    pool.release(device[::-1])
    hashes = [h(0), h(1), h(2), h(3), h(4)]
    num_device, dest = host.begin_load("req@1", hashes)
    assert num_device == 2 and len(dest) == 3
    assert [pool.ref_count(b) for b in device] == [1, 1]  # the load owns the device hits
    assert host.commit_load("req@1", 2) == 2  # two of three blocks landed
    assert pool.lookup(hashes) == device + dest[:2]
    pool.acquire(device + dest[:2])  # what add_request does
    host.end_load("req@1")
    assert pool.num_used == 4
    pool.release((device + dest[:2])[::-1])
    assert pool.num_used == 0 and pool.num_free == 8

    num_device, dest = host.begin_load("req@2", [h(0), h(9)])
    assert (num_device, len(dest)) == (1, 1) and pool.num_used == 2
    assert host.cancel_load("req@2") and not host.cancel_load("req@2")
    assert pool.num_used == 0 and pool.num_free == 8 and pool.lookup([h(9)]) == []
    pool.check_integrity()


def test_load_takes_only_free_blocks() -> None:
    pool, _, host, _ = setup(num_blocks=3, staging=0)
    held = pool.allocate(2)
    num_device, dest = host.begin_load("req@1", [h(0), h(1), h(2)])
    assert (num_device, len(dest)) == (0, 1)
    host.cancel_load("req@1")
    pool.release(held)
    pool.check_integrity()
