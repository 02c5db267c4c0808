"""The kvstore process: ``python -m glmserve.services.kvstore.main --host H --port P
[--redis-url redis://127.0.0.1:6379/0] [--metrics-port M] [--host-tier-bytes N --transfer auto|nixl|tcp]``.

Serves the block index over gRPC (in memory, or in Redis with ``--redis-url`` so several routers
share it) with ``grpc.health.v1`` for probes, logs which index it uses, exports Prometheus metrics on ``--metrics-port``, and stops
cleanly on SIGTERM / SIGINT (exit status 0). A Redis that is down at start is not fatal: the
service comes up, Health reports ``index_up: false`` and index calls fail with UNAVAILABLE until
Redis is back. ``--host-tier-bytes`` adds the host (CPU) KV block tier (`host_tier`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from glmserve.kv.block_index import BlockIndex, InMemoryBlockIndex
from glmserve.kv.transfer import make_backend
from glmserve.kv.transfer.timeouts import AGREED
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2 as pb
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from glmserve.services.kvstore.host_tier import HostTier
from glmserve.services.kvstore.metrics import KVStoreMetrics
from glmserve.services.kvstore.records import MemoryRecords, Records, RedisRecords
from glmserve.services.kvstore.redis_index import RedisBlockIndex
from glmserve.services.kvstore.servicer import KVStoreServicer
from glmserve.services.metrics_exposition import MetricsServer, add_process_metrics, labelled

log = logging.getLogger("glmserve.kvstore")


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = "127.0.0.1"
    port: int = 50070  # 0: any free port (logged)
    redis_url: str | None = None  # None: the index lives in this process
    redis_key_prefix: str = "glmserve"
    redis_timeout_s: float = 0.5
    metrics_port: int | None = None  # None: no metrics endpoint
    served_model_name: str | None = None  # the metrics' model_name label
    threads: int = 8  # gRPC handler threads
    grace_s: float = 2.0  # how long in-flight RPCs may finish on shutdown
    host_tier_bytes: int = 0  # 0: no host tier
    transfer: str = "auto"  # host-tier transfer backend: auto (NIXL when it imports), nixl, tcp
    host_lease_timeout_s: float = AGREED.lease_s  # > the workers' write timeout + drain
    host_holder_id: str = "host"  # index holder id of host-tier blocks
    check_integrity: bool = False  # check the host pool after every operation (tests)
    fault_load_delay_s: float = 0.0  # test-only fault injection (see HostTier)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be in [0, 65535], got {self.metrics_port}")
        schemes = ("redis://", "rediss://", "unix://")
        if self.redis_url is not None and not self.redis_url.startswith(schemes):
            raise ValueError(f"redis_url: must start with one of {schemes}, got {self.redis_url!r}")
        if self.host_tier_bytes < 0:
            raise ValueError(f"host_tier_bytes: must be >= 0, got {self.host_tier_bytes}")
        if self.transfer not in ("auto", "nixl", "tcp"):
            raise ValueError(f"transfer: must be auto, nixl or tcp, got {self.transfer!r}")
        if self.host_lease_timeout_s <= 0:
            raise ValueError(f"host_lease_timeout_s: must be > 0, got {self.host_lease_timeout_s}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> KVStoreConfig:
        p = argparse.ArgumentParser(prog="python -m glmserve.services.kvstore.main",
                                    description="glmserve kvstore: the cluster block index over gRPC")
        p.add_argument("--host", default=cls.host)
        p.add_argument("--port", type=int, default=cls.port)
        p.add_argument("--redis-url", default=None, help="keep the index in Redis (shared by routers)")
        p.add_argument("--redis-key-prefix", default=cls.redis_key_prefix)
        p.add_argument("--redis-timeout", type=float, default=cls.redis_timeout_s, dest="redis_timeout_s")
        p.add_argument("--metrics-port", type=int, default=None)
        p.add_argument("--served-model-name", default=None, help="the model_name label of the metrics")
        p.add_argument("--threads", type=int, default=cls.threads)
        p.add_argument("--host-tier-bytes", type=int, default=0,
                       help="size of the host (CPU) KV block tier; 0: none")
        p.add_argument("--transfer", choices=("auto", "nixl", "tcp"), default="auto",
                       help="host-tier KV transfer: NIXL when it imports (auto), or TCP")
        p.add_argument("--host-lease-timeout-s", type=float, default=cls.host_lease_timeout_s)
        p.add_argument("--host-holder-id", default=cls.host_holder_id)
        p.add_argument("--check-integrity", action="store_true",
                       help="check the host pool after every operation (for tests)")
        p.add_argument("--fault-load-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
        return cls(**vars(p.parse_args(argv)))

    def build_index(self) -> BlockIndex:
        if self.redis_url is None:
            return InMemoryBlockIndex()
        return RedisBlockIndex(self.redis_url, key_prefix=self.redis_key_prefix,
                               timeout_s=self.redis_timeout_s)


    def build_records(self) -> Records:
        """Client records (stored Responses): in Redis with the index, else in this process."""
        if self.redis_url is None:
            return MemoryRecords()
        return RedisRecords(self.redis_url, key_prefix=self.redis_key_prefix, timeout_s=self.redis_timeout_s)

    def build_host_tier(self, index: BlockIndex) -> HostTier | None:
        if self.host_tier_bytes == 0:
            return None
        transfer = make_backend(self.transfer, host=self.host, timeout_s=AGREED.write_s)  # writes into worker blocks
        return HostTier(self.host_tier_bytes, transfer, index, holder_id=self.host_holder_id,
                        lease_timeout_s=self.host_lease_timeout_s, check_integrity=self.check_integrity,
                        fault_load_delay_s=self.fault_load_delay_s)


def serve(config: KVStoreConfig, stop: threading.Event) -> None:
    """Runs the service until ``stop`` is set."""
    index = config.build_index()
    host_tier = config.build_host_tier(index)
    metrics = KVStoreMetrics(index, host_tier=host_tier)
    add_process_metrics(metrics.registry, "kvstore")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.threads))
    records = config.build_records()
    pb_grpc.add_KVStoreServicer_to_server(KVStoreServicer(index, metrics, host_tier, records), server)
    probes = health.HealthServicer()  # grpc.health.v1: SERVING while this process serves
    health_pb2_grpc.add_HealthServicer_to_server(probes, server)
    for service in ("", pb.DESCRIPTOR.services_by_name["KVStore"].full_name):
        probes.set(service, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    http = None
    if config.metrics_port is not None:
        labels = {"role": "kvstore"} | ({"model_name": config.served_model_name} if config.served_model_name else {})
        http = MetricsServer(labelled(metrics.registry, labels), config.host, config.metrics_port)
    server.start()
    log.info("kvstore serving on %s:%d; index: %s; metrics: %s", config.host, port, index.describe(),
             f"{config.host}:{http.port}" if http is not None else "off")
    if not index.healthy():
        log.warning("index backend unreachable (%s): index calls fail with UNAVAILABLE until it is back",
                    index.describe())
    if host_tier is not None:
        log.info("host tier: up to %d bytes, %s transfer (sized when the first worker attaches)",
                 config.host_tier_bytes, host_tier.backend.kind)
    try:
        while not stop.wait(0.5):  # short waits keep the main thread responsive to signals
            if host_tier is not None:
                host_tier.expire()  # the lease timeout backstop
                host_tier.sync_index()  # after a Redis restart, the host tier's blocks are indexed again
    finally:
        log.info("kvstore stopping")
        probes.enter_graceful_shutdown()
        server.stop(config.grace_s).wait()
        if http is not None:
            http.close()
        if host_tier is not None:
            host_tier.close()
        index.close()
        if isinstance(records, RedisRecords):
            records.close()
        log.info("kvstore stopped")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = KVStoreConfig.from_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(config, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
