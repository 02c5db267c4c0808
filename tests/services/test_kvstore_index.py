"""BlockIndex contract, run against both implementations: in memory, and in a real redis-server."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from redis_fixtures import RedisServer, free_port, requires_redis_server

from glmserve.kv.block_index import (
    BlockIndex,
    IndexUnavailable,
    InMemoryBlockIndex,
    PrefixMatch,
    Tier,
    stage_worker_id,
)
from glmserve.services.kvstore.redis_index import RedisBlockIndex

H = [bytes([i]) * 16 for i in range(200)]  # stand-ins for chain hashes, prompt order
D, HOST = Tier.DEVICE, Tier.HOST


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", pytest.param("redis", marks=requires_redis_server)])
def index(request: pytest.FixtureRequest) -> Iterator[BlockIndex]:
    if request.param == "memory":
        yield InMemoryBlockIndex()
        return
    server = request.getfixturevalue("redis_server")
    # Small chunks so the pipelined walk crosses chunk boundaries; a fresh prefix isolates tests.
    idx = RedisBlockIndex(server.url, key_prefix=f"t{uuid.uuid4().hex[:8]}", first_chunk=4, max_chunk=16)
    yield idx
    idx.close()


def test_leading_run_per_worker_and_tier(index: BlockIndex) -> None:
    index.stored("w1", D, H[:4])
    index.stored("w2", D, H[:2])
    index.stored("w2", HOST, H[:5])
    index.stored("w3", D, H[2:5])  # no block 0: nothing reusable
    assert index.match(H[:6]) == {"w1": PrefixMatch(4, 0), "w2": PrefixMatch(2, 5)}
    assert index.match(H[:3]) == {"w1": PrefixMatch(3, 0), "w2": PrefixMatch(2, 3)}
    assert list(index.match(H[:6])) == ["w1", "w2"]  # sorted keys


def test_a_layersplit_replica_holds_a_block_when_every_stage_does(index: BlockIndex) -> None:
    """Each stage holds its slice of a block; the replica is matched under its own id, on the
    shortest stage's run (a stage that evicted a block ends the replica's run there)."""
    s0, s1 = stage_worker_id("p0", 0, 2), stage_worker_id("p0", 1, 2)
    assert stage_worker_id("p1", 0, 1) == "p1"  # a one-stage replica is a plain worker
    index.stored(s0, D, H[:5])
    index.stored(s1, D, H[:3])
    index.stored(stage_worker_id("p2", 0, 2), D, H[:5])  # p2's second stage holds nothing
    assert index.match(H[:6]) == {"p0": PrefixMatch(3, 0)}
    index.removed(s1, D, [H[1]])
    assert index.match(H[:6]) == {"p0": PrefixMatch(1, 0)}
    index.remove_worker(s0)
    assert index.match(H[:6]) == {}
    with pytest.raises(ValueError, match="stage"):
        stage_worker_id("p0", 2, 2)


def test_a_gap_ends_the_run(index: BlockIndex) -> None:
    index.stored("w1", D, [H[0], H[1], H[3], H[4]])
    index.stored("w1", HOST, [H[1], H[2]])  # host run must start at block 0 too
    assert index.match(H[:5]) == {"w1": PrefixMatch(2, 0)}


def test_long_prompt_crosses_chunks(index: BlockIndex) -> None:
    index.stored("w1", D, H[:37])
    index.stored("w2", HOST, H[:150])
    assert index.match(H) == {"w1": PrefixMatch(37, 0), "w2": PrefixMatch(0, 150)}


def test_removed_blocks(index: BlockIndex) -> None:
    index.stored("w1", D, H[:4])
    index.stored("w1", HOST, H[:4])
    index.removed("w1", D, [H[2]])
    assert index.match(H[:4]) == {"w1": PrefixMatch(2, 4)}
    index.removed("w1", HOST, [H[0], H[99]])  # an unknown hash is ignored
    assert index.match(H[:4]) == {"w1": PrefixMatch(2, 0)}
    index.removed("w1", D, H[:4])
    assert index.match(H[:4]) == {}
    assert index.block_counts() == {D: 0, HOST: 3}


def test_remove_worker(index: BlockIndex) -> None:
    index.stored("w1", D, H[:3])
    index.stored("w1", HOST, H[:2])
    index.stored("w2", D, H[:1])
    assert index.remove_worker("w1") == 5
    assert index.match(H[:3]) == {"w2": PrefixMatch(1, 0)}
    assert index.remove_worker("w1") == 0
    assert index.remove_worker("never-seen") == 0
    assert index.block_counts() == {D: 1, HOST: 0}


def test_unknown_hashes_and_empty_prompt(index: BlockIndex) -> None:
    assert index.match([b"\xff" * 16]) == {}
    assert index.match([]) == {}
    index.stored("w1", D, H[:2])
    assert index.match([b"\xff" * 16, *H[:2]]) == {}


def test_stored_is_idempotent_and_counted(index: BlockIndex) -> None:
    index.stored("w1", D, H[:3])
    index.stored("w1", D, H[:3])
    index.stored("w2", D, H[:2])
    index.stored("w2", "host", H[:1])  # tiers also accepted by value
    assert index.block_counts() == {D: 5, HOST: 1}
    assert index.match(H[:3])["w1"] == PrefixMatch(3, 0)


def test_worker_ids_with_separators(index: BlockIndex) -> None:
    index.stored("pod|a:device", D, H[:2])
    assert index.match(H[:2]) == {"pod|a:device": PrefixMatch(2, 0)}
    assert index.remove_worker("pod|a:device") == 2


@pytest.mark.parametrize(
    ("worker", "tier", "hashes", "field"),
    [("", D, H[:1], "worker"), ("w1", "gpu", H[:1], "tier"), ("w1", D, [b""], "hashes")],
)
def test_bad_arguments_name_the_field(
    index: BlockIndex, worker: str, tier: str, hashes: list[bytes], field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        index.stored(worker, tier, hashes)
    assert index.block_counts() == {D: 0, HOST: 0}


def test_healthy(index: BlockIndex) -> None:
    assert index.healthy()


@requires_redis_server
def test_redis_index_is_shared(redis_server: RedisServer) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a, b = (RedisBlockIndex(redis_server.url, key_prefix=prefix) for _ in range(2))
    a.stored("w1", D, H[:3])
    assert b.match(H[:3]) == {"w1": PrefixMatch(3, 0)}
    assert b.remove_worker("w1") == 3
    assert a.match(H[:3]) == {}


def test_unreachable_redis_fails_fast() -> None:
    idx = RedisBlockIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)  # nobody listens
    assert not idx.healthy()
    for call in (
        lambda: idx.stored("w1", D, H[:2]),
        lambda: idx.match(H[:2]),
        lambda: idx.remove_worker("w1"),
        idx.block_counts,
    ):
        start = time.monotonic()
        with pytest.raises(IndexUnavailable, match="unreachable"):
            call()
        assert time.monotonic() - start < 1.0
