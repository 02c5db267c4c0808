"""The kvstore service as a real process on 127.0.0.1, driven over gRPC with the client."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from redis_fixtures import RedisServer, free_port, requires_redis_server
from worker_fixtures import MetricSamples, metric_samples

from glmserve.kv.block_index import PrefixMatch, Tier
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2 as pb
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from glmserve.services.kvstore.client import AsyncKVStoreClient, BlockEvent, KVStoreClient, KVStoreError

H = [bytes([i]) * 16 for i in range(8)]
D, HOST = Tier.DEVICE, Tier.HOST


class KVStoreProcess:
    """``python -m glmserve.services.kvstore.main`` in a subprocess; ``stop()`` sends SIGTERM."""

    def __init__(self, log: Path, redis_url: str | None = None) -> None:
        self.port, self.metrics_port, self.log = free_port(), free_port(), log
        cmd = [
            sys.executable,
            "-m",
            "glmserve.services.kvstore.main",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
        ]
        if redis_url is not None:
            cmd += ["--redis-url", redis_url, "--redis-timeout", "0.2"]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.client = KVStoreClient(f"127.0.0.1:{self.port}", timeout_s=2.0)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:  # a loaded 2-core machine imports slowly
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client.health()
                return
            except KVStoreError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kvstore did not start:\n{self.log.read_text()}") from None
                time.sleep(0.05)

    def metrics(self) -> MetricSamples:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return metric_samples(r.read().decode())

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture
def memory_kvstore(tmp_path: Path) -> Iterator[KVStoreProcess]:
    kv = KVStoreProcess(tmp_path / "kvstore.log")
    yield kv
    kv.stop()


def test_in_memory_service(memory_kvstore: KVStoreProcess) -> None:
    client = memory_kvstore.client
    assert client.health().backend == "memory" and client.health().index_up
    client.publish_stored("w1", D, H[:4])
    client.publish_stored("w2", HOST, H[:6])
    assert client.publish([BlockEvent("removed", "w1", D, [H[3]]), BlockEvent("stored", "w3", D, H[1:])]) == 2
    assert client.lookup(H) == {"w1": PrefixMatch(3, 0), "w2": PrefixMatch(0, 6)}
    assert client.remove_worker("w2") == 6
    assert client.lookup(H) == {"w1": PrefixMatch(3, 0)}
    client.publish_removed("w1", D, H[:1])
    assert client.lookup(H) == {}

    samples = memory_kvstore.metrics()
    for name, labels, value in (
        ("glmserve_kvstore_events_total", (("kind", "stored"),), 3.0),
        ("glmserve_kvstore_events_total", (("kind", "removed"),), 2.0),
        ("glmserve_kvstore_lookups_total", (), 3.0),
        ("glmserve_kvstore_indexed_blocks", (("tier", "device"),), 9.0),
        ("glmserve_kvstore_indexed_blocks", (("tier", "host"),), 0.0),
        ("glmserve_kvstore_index_up", (), 1.0),
    ):
        assert samples[name, labels] == value, name

    assert memory_kvstore.stop() == 0  # SIGTERM: clean exit
    log = memory_kvstore.log.read_text()
    assert "index: memory" in log and "kvstore stopped" in log


def test_bad_batch_is_rejected_whole(memory_kvstore: KVStoreProcess) -> None:
    with pytest.raises(ValueError, match="^worker:"):  # the client checks before sending
        memory_kvstore.client.publish(
            [BlockEvent("stored", "w1", D, H[:2]), BlockEvent("stored", "", D, H[:2])]
        )
    # Around the client, the server rejects the whole batch.
    with grpc.insecure_channel(f"127.0.0.1:{memory_kvstore.port}") as channel:
        stub = pb_grpc.KVStoreStub(channel)
        batch = pb.EventBatch(
            events=[
                pb.BlockEvent(kind=pb.EVENT_KIND_STORED, worker_id="w1", tier=tier, block_hashes=H[:2])
                for tier in (pb.TIER_DEVICE, pb.TIER_UNSPECIFIED)
            ]
        )
        with pytest.raises(grpc.RpcError) as rpc:
            stub.PublishEvents(batch, timeout=2)
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "events[1].tier" in rpc.value.details()
    assert memory_kvstore.client.lookup(H) == {}  # the valid first event was not applied either


def test_async_client(memory_kvstore: KVStoreProcess) -> None:
    async def run() -> dict[str, PrefixMatch]:
        async with AsyncKVStoreClient(f"127.0.0.1:{memory_kvstore.port}") as client:
            await client.publish_stored("w1", D, H[:2])
            return await client.lookup(H)

    assert asyncio.run(run()) == {"w1": PrefixMatch(2, 0)}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@requires_redis_server
def test_redis_index_survives_kvstore_restart(redis_server: RedisServer, tmp_path: Path) -> None:
    first = KVStoreProcess(tmp_path / "kv1.log", redis_server.url)
    first.client.publish_stored("w1", D, H[:5])
    assert first.stop() == 0
    second = KVStoreProcess(tmp_path / "kv2.log", redis_server.url)
    try:
        assert second.client.health().backend == "redis"
        assert second.client.lookup(H) == {"w1": PrefixMatch(5, 0)}
        assert "index: redis redis://127.0.0.1" in (tmp_path / "kv2.log").read_text()
    finally:
        assert second.stop() == 0


@requires_redis_server
def test_redis_down_is_reported_not_hung(redis_server: RedisServer, tmp_path: Path) -> None:
    kv = KVStoreProcess(tmp_path / "kv.log", redis_server.url)
    try:
        kv.client.publish_stored("w1", D, H[:2])
        redis_server.stop()

        health = kv.client.health()
        assert not health.index_up and "redis" in health.detail
        start = time.monotonic()
        with pytest.raises(KVStoreError) as e:
            kv.client.lookup(H)
        assert time.monotonic() - start < 1.5
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.unavailable
        assert "block index unavailable" in e.value.details
        assert kv.metrics()["glmserve_kvstore_index_up", ()] == 0.0

        redis_server.start()  # same port, empty (no persistence): the service recovers by itself
        assert kv.client.health().index_up
        kv.client.publish_stored("w1", D, H[:1])
        assert kv.client.lookup(H) == {"w1": PrefixMatch(1, 0)}
    finally:
        assert kv.stop() == 0
