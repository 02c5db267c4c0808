"""The kvstore's host tier over gRPC, with this test process as the worker: a real kvstore process,
a real transfer backend (TCP, and NIXL where it imports) and a CPU buffer standing in for a KV cache.

Bytes written to the host come back exactly on load, into other rows; hashes become visible only
after commit and enter the block index as TIER_HOST; a write in flight is never evicted; errors are
clear status codes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from host_tier_fixtures import HostKVStore
from redis_fixtures import RedisServer, requires_redis_server

from glmserve.kv.block_index import PrefixMatch
from glmserve.kv.host_pool import write_stamp
from glmserve.kv.transfer import make_backend, nixl_unavailable_reason
from glmserve.services.kvstore.client import AsyncKVStoreClient, KVStoreError

_NIXL = nixl_unavailable_reason()
TRANSFERS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(_NIXL is not None, reason=f"nixl: {_NIXL}"))]
BLOCK_BYTES = 4096
HOST_BLOCKS = 4
H = [bytes([i + 1]) * 16 for i in range(12)]


@pytest.fixture(params=TRANSFERS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def kvstore(kind: str, tmp_path: Path) -> Iterator[HostKVStore]:
    kv = HostKVStore(tmp_path / "kvstore.log", kind, HOST_BLOCKS * BLOCK_BYTES, "--check-integrity")
    try:
        yield kv
    finally:
        assert kv.stop() == 0
    assert "Traceback" not in (tmp_path / "kvstore.log").read_text()


async def _write(client: AsyncKVStoreClient, backend, peer: str, hashes: list[bytes], rows: list[int]) -> int:
    grant = await client.host_begin_write("w", hashes)
    if not grant.lease_id:
        return 0
    row_of = dict(zip(hashes, rows, strict=True))
    handle = backend.write(peer, write_stamp(grant.lease_id), [row_of[h] for h in grant.hashes], grant.block_ids)
    assert await asyncio.to_thread(handle.wait, 30) == "done"
    return await client.host_end_write(grant.lease_id, committed=True)


def test_roundtrip_visibility_index_and_pressure(kind: str, kvstore: HostKVStore) -> None:
    buffer = torch.arange(12 * BLOCK_BYTES, dtype=torch.int64).remainder(251).to(torch.uint8).view(12, BLOCK_BYTES)

    async def go() -> None:
        backend = make_backend(kind, **({"host": "127.0.0.1"} if kind == "tcp" else {}))
        backend.register(buffer)
        async with AsyncKVStoreClient(kvstore.address, timeout_s=5.0) as client:
            with pytest.raises(KVStoreError) as e:
                await client.host_begin_write("w", H[:1])  # nobody attached: no size yet
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            other = "tcp" if kind == "nixl" else "nixl"
            with pytest.raises(KVStoreError) as e:
                await client.host_attach("w", other, BLOCK_BYTES, b"{}")
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            attachment = await client.host_attach("w", kind, BLOCK_BYTES, backend.target_info())
            assert (attachment.num_blocks, attachment.holder_id) == (HOST_BLOCKS, "host")
            peer = await asyncio.to_thread(backend.connect, attachment.target_info)

            # Write rows 0..2 as H[0..2]; visible only after commit; indexed as TIER_HOST.
            grant = await client.host_begin_write("w", H[:3])
            assert grant.hashes == H[:3] and grant.block_ids == [0, 1, 2]
            assert await client.host_lookup(H[:3]) == 0
            handle = backend.write(peer, write_stamp(grant.lease_id), [0, 1, 2], grant.block_ids)
            assert await asyncio.to_thread(handle.wait, 30) == "done"
            assert await client.host_end_write(grant.lease_id, committed=True) == 3
            assert await client.host_lookup(H[:4]) == 3
            assert kvstore.client.lookup(H[:3]) == {"host": PrefixMatch(0, 3)}

            # Load H[0..2] back into rows 8..10: the exact bytes of rows 0..2.
            outcome = await client.host_load("w", "load-a", 1, H[:3], [8, 9, 10], timeout_s=30)
            assert (outcome.blocks_loaded, outcome.drained, outcome.error) == (3, True, "")
            assert torch.equal(buffer[8:11], buffer[0:3])

            # Pressure: a write in flight (not committed) is never evicted; committed ones are, LRU.
            pending = await client.host_begin_write("w", [H[5], H[6]])  # 1 free block, then evicts H[0]
            assert pending.hashes == [H[5], H[6]]
            assert kvstore.client.lookup(H[:1]) == {}  # the eviction reached the index
            assert (await client.host_begin_write("w", [H[7], H[8], H[9]])).hashes == [H[7], H[8]]
            assert (await client.host_begin_write("w", [H[10]])).lease_id == 0  # all pinned or in flight
            await client.host_end_write(pending.lease_id, committed=False)  # given back, drained
            assert await client.host_lookup([H[5]]) == 0
            with pytest.raises(KVStoreError) as e:
                await client.host_end_write(pending.lease_id, committed=True)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            assert await client.host_cancel_load("no-such-load", 1) == (False, True)
        await asyncio.to_thread(backend.close)

    asyncio.run(go())
    assert kvstore.metrics()["glmserve_host_tier_evictions_total"] == 3  # H[0], then H[1] and H[2]


@requires_redis_server
def test_host_blocks_are_indexed_again_after_a_redis_restart(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    kvstore = HostKVStore(tmp_path / "kvstore.log", "tcp", HOST_BLOCKS * BLOCK_BYTES, "--redis-url", redis.url)
    buffer = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8)

    async def go() -> None:
        backend = make_backend("tcp", host="127.0.0.1")
        backend.register(buffer)
        async with AsyncKVStoreClient(kvstore.address, timeout_s=5.0) as client:
            attachment = await client.host_attach("w", "tcp", BLOCK_BYTES, backend.target_info())
            peer = await asyncio.to_thread(backend.connect, attachment.target_info)
            assert await _write(client, backend, peer, H[:3], [0, 1, 2]) == 3
        await asyncio.to_thread(backend.close)

    try:
        asyncio.run(go())
        assert kvstore.client.lookup(H[:3]) == {"host": PrefixMatch(0, 3)}
        redis.stop()
        redis.start()  # no persistence: the index is empty, the host tier still holds the blocks
        deadline = time.monotonic() + 10
        while kvstore.client.lookup(H[:3]) != {"host": PrefixMatch(0, 3)}:
            assert time.monotonic() < deadline, "the host tier's blocks were not indexed again"
            time.sleep(0.1)
    finally:
        assert kvstore.stop() == 0
        redis.stop()
