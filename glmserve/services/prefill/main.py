"""The prefill worker process:

``python -m glmserve.services.prefill.main --model DIR --host 127.0.0.1 --port P --worker-id ID
--transfer auto|nixl|tcp [--metrics-port M] [--kv-cache-bytes N] [--transfer-timeout-s S]``

Loads the model, registers its KV cache with the transfer backend (the choice is logged), serves
``glmserve.prefill.v1.Prefill`` over gRPC, prints ``READY <host>:<port>`` when it takes requests, and
on SIGTERM / SIGINT aborts and drains its transfers before it exits (status 0).
``--transfer-timeout-s``: a write still running after this is failed and fenced; keep it, plus the
5 s drain, below the decode workers' ``--prefill-timeout-s`` (the timeout both sides agree on).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as pb_grpc
from glmserve.services.prefill.servicer import PrefillServicer
from glmserve.services.prefill.worker import PrefillWorker
from glmserve.services.worker_metrics import WorkerMetrics
from glmserve.services.worker_server import (
    DEFAULT_STAGING_BLOCKS,
    DEFAULT_TRANSFER_TIMEOUT_S,
    add_common_args,
    build_backend,
    build_engine,
    check_kvstore,
    check_port,
    engine_options,
    expose_block_events,
    host_settings,
    run_worker,
    setup_logging,
    start_block_events,
)


@dataclass(frozen=True)
class PrefillConfig:
    model: str
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 0
    transfer: str = "auto"
    metrics_port: int | None = None
    kv_cache_bytes: int | None = None
    kvstore: str | None = None  # host:port: publish block events to its index, use its host tier
    revision: str | None = None  # explicit model revision for the prefix-cache key
    host_write_through: str = "on"
    host_staging_blocks: int = DEFAULT_STAGING_BLOCKS
    check_integrity: bool = False
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S

    def __post_init__(self) -> None:
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        check_kvstore(self.kvstore)
        if not self.worker_id:
            raise ValueError("worker_id: must not be empty")
        if self.host_write_through not in ("on", "off"):
            raise ValueError(f"host_write_through: must be 'on' or 'off', got {self.host_write_through!r}")
        if self.host_staging_blocks < 0:
            raise ValueError(f"host_staging_blocks: must be >= 0, got {self.host_staging_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be > 0, got {self.kv_cache_bytes}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: must be > 0, got {self.transfer_timeout_s}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> PrefillConfig:
        p = argparse.ArgumentParser(prog="python -m glmserve.services.prefill.main",
                                    description="glmserve prefill worker")
        add_common_args(p)
        p.add_argument("--transfer-timeout-s", type=float, default=DEFAULT_TRANSFER_TIMEOUT_S)
        return cls(**vars(p.parse_args(argv)))

    def engine_config(self) -> dict[str, int | bool]:
        return engine_options(self.kv_cache_bytes, self.kvstore, self.host_staging_blocks, self.check_integrity)


async def serve(config: PrefillConfig) -> int:
    publisher = start_block_events(config.kvstore, config.worker_id)
    backend = build_backend(config.transfer, config.host, config.transfer_timeout_s)
    worker = PrefillWorker(
        lambda: build_engine(config.model, config.revision, config.engine_config(), publisher),
        backend,
        metrics=lambda engine: WorkerMetrics("prefill", config.worker_id, lambda: engine.snapshot),
        host=host_settings(config.kvstore, config.worker_id, config.host_write_through),
    )
    servicer = PrefillServicer(worker, config.worker_id)
    expose_block_events(publisher, worker.metrics.registry if worker.metrics is not None else None)
    try:
        return await run_worker(
            worker,
            lambda server: pb_grpc.add_PrefillServicer_to_server(servicer, server),
            host=config.host,
            port=config.port,
            registry=worker.metrics.registry if worker.metrics is not None else None,
            metrics_port=config.metrics_port,
            name=f"prefill worker {config.worker_id} ({backend.kind} transfer)",
        )
    finally:
        if publisher is not None:
            await asyncio.to_thread(publisher.close)


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    return asyncio.run(serve(PrefillConfig.from_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
