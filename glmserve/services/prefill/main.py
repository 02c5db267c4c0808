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

from glmserve.kv.transfer import make_backend
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as pb_grpc
from glmserve.services.prefill.servicer import PrefillServicer
from glmserve.services.prefill.worker import PrefillWorker
from glmserve.services.tracing import Tracing
from glmserve.services.worker_metrics import WorkerMetrics
from glmserve.services.worker_server import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    WorkerConfig,
    add_common_args,
    build_engine,
    serve_worker,
    setup_logging,
    start_block_events,
)


@dataclass(frozen=True)
class PrefillConfig(WorkerConfig):
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: must be > 0, got {self.transfer_timeout_s}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> PrefillConfig:
        p = argparse.ArgumentParser(prog="python -m glmserve.services.prefill.main",
                                    description="glmserve prefill worker")
        add_common_args(p)
        p.add_argument("--transfer-timeout-s", type=float, default=DEFAULT_TRANSFER_TIMEOUT_S)
        return cls(**vars(p.parse_args(argv)))


async def serve(config: PrefillConfig) -> int:
    publisher = start_block_events(config.kvstore, config.worker_id)
    backend = make_backend(config.transfer, host=config.host, timeout_s=config.transfer_timeout_s)
    worker = PrefillWorker(
        lambda: build_engine(config.model, config.revision, config.engine_config(), publisher),
        backend,
        metrics=lambda engine: WorkerMetrics("prefill", config.worker_id, lambda: engine.snapshot),
        host_tier=config.host_tier_settings(),
    )
    servicer = PrefillServicer(worker, config.worker_id)
    return await serve_worker(config, worker, lambda server: pb_grpc.add_PrefillServicer_to_server(servicer, server),
                              worker.metrics.registry if worker.metrics is not None else None, publisher,
                              f"prefill worker {config.worker_id} ({backend.kind} transfer)", role="prefill",
                              tracing=Tracing.from_env("prefill"),
                              service=pb.DESCRIPTOR.services_by_name["Prefill"].full_name)


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    return asyncio.run(serve(PrefillConfig.from_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
