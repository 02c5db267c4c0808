"""KVEventPublisher against a real kvstore gRPC server (in this process, on 127.0.0.1): exact
index contents after batches, an outage that must not block the pool, and the resync after it."""

from __future__ import annotations

import time

from kvstore_fixtures import kvstore
from redis_fixtures import RedisServer, free_port, requires_redis_server

from glmserve.kv.block_index import PrefixMatch
from glmserve.kv.block_pool import BlockPool
from glmserve.services.kv_events import KVEventPublisher
from glmserve.services.kvstore.client import KVStoreClient

H = [bytes([i + 1]) * 16 for i in range(8)]


def committed_pool(n: int, hashes: list[bytes], publisher: KVEventPublisher) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(n)
    pool.add_listener(publisher)
    ids = pool.allocate(len(hashes))
    for block_id, h in zip(ids, hashes, strict=True):
        pool.commit(block_id, h)
    return pool, ids


def test_stored_and_evicted_blocks_reach_the_index() -> None:
    port = free_port()
    with kvstore(port) as client:
        publisher = KVEventPublisher("w1", KVStoreClient(f"127.0.0.1:{port}", timeout_s=1.0))
        pool, ids = committed_pool(4, H[:4], publisher)
        assert publisher.flush()
        assert client.lookup(H[:4]) == {"w1": PrefixMatch(4, 0)}
        pool.release(ids[::-1])  # the tail is evicted first
        pool.allocate(1)
        assert publisher.flush()
        assert client.lookup(H[:4]) == {"w1": PrefixMatch(3, 0)}
        publisher.close()  # leaving the cluster drops everything it held
        assert client.lookup(H[:4]) == {}


def test_an_outage_never_blocks_the_pool_and_the_index_is_resynced_after_it() -> None:
    port = free_port()
    publisher = KVEventPublisher("w1", KVStoreClient(f"127.0.0.1:{port}", timeout_s=0.3))
    with kvstore(port) as client:
        pool, ids = committed_pool(8, H[:3], publisher)
        assert publisher.flush() and publisher.in_sync
        assert client.lookup(H[:3]) == {"w1": PrefixMatch(3, 0)}
    # kvstore down: the pool keeps working; events are folded into the mirror, nothing waits.
    t0 = time.monotonic()
    more = pool.allocate(2)
    pool.commit(more[0], H[3])
    pool.commit(more[1], H[4])
    assert time.monotonic() - t0 < 0.05
    assert not publisher.flush() and not publisher.in_sync
    pool.release([more[1]])
    pool.allocate(4)  # evicts H[4] while the kvstore is away
    with kvstore(port) as client:  # an empty index, as after a kvstore restart
        assert client.lookup(H[:5]) == {}
        assert publisher.flush() and publisher.in_sync
        assert client.lookup(H[:5]) == {"w1": PrefixMatch(4, 0)}
        assert client.lookup([H[4]]) == {}
    publisher.close()  # kvstore gone again: close must still return promptly


def test_a_kvstore_restart_between_flushes_is_seen_by_its_epoch_and_resynced() -> None:
    port = free_port()
    publisher = KVEventPublisher("w1", KVStoreClient(f"127.0.0.1:{port}", timeout_s=0.5), epoch_check_s=0.1)
    with kvstore(port) as client:
        committed_pool(4, H[:3], publisher)
        assert publisher.flush() and client.lookup(H[:3]) == {"w1": PrefixMatch(3, 0)}
    with kvstore(port) as client:  # restarted while the worker was idle: no publish ever failed
        assert client.lookup(H[:3]) == {}
        time.sleep(0.15)  # an epoch check is due
        assert publisher.flush() and publisher.resyncs == 2
        assert client.lookup(H[:3]) == {"w1": PrefixMatch(3, 0)}
    assert publisher.failures == 0


@requires_redis_server
def test_the_index_is_rebuilt_after_a_redis_restart(tmp_path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    port = free_port()
    try:
        with kvstore(port, redis_url=redis.url) as client:
            publisher = KVEventPublisher("w1", KVStoreClient(f"127.0.0.1:{port}", timeout_s=0.5),
                                         epoch_check_s=0.1)
            committed_pool(4, H[:4], publisher)
            assert publisher.flush() and client.lookup(H[:4]) == {"w1": PrefixMatch(4, 0)}
            redis.stop()
            redis.start()  # same port, no persistence: every key is gone
            assert client.lookup(H[:4]) == {}
            deadline = time.monotonic() + 5
            while client.lookup(H[:4]) != {"w1": PrefixMatch(4, 0)}:
                assert time.monotonic() < deadline, "the index was not rebuilt"
                publisher.flush()
                time.sleep(0.05)
            publisher.close()
    finally:
        redis.stop()


def test_publisher_state_is_exposed_as_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from glmserve.services.kv_events import PublisherCollector

    port = free_port()
    publisher = KVEventPublisher("w1", KVStoreClient(f"127.0.0.1:{port}", timeout_s=0.3))
    registry = CollectorRegistry()
    registry.register(PublisherCollector(publisher))
    assert not publisher.flush()  # nothing listens on the port yet: the kvstore is still starting
    assert registry.get_sample_value("glmserve_kv_index_in_sync") == 0
    assert registry.get_sample_value("glmserve_kv_events_publish_failures_total") == 0
    with kvstore(port):
        committed_pool(2, H[:2], publisher)
        assert publisher.flush()
        assert registry.get_sample_value("glmserve_kv_index_in_sync") == 1
        assert registry.get_sample_value("glmserve_kv_index_resyncs_total") == 1
        assert registry.get_sample_value("glmserve_kv_events_published_total") == 1  # one stored event
    publisher.block_stored(H[2])
    assert not publisher.flush()  # reached once, now gone: a real failure
    assert registry.get_sample_value("glmserve_kv_events_publish_failures_total") == 1
    publisher.close()
