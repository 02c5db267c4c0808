"""The decode worker process:

``python -m glmserve.services.decode.main --model DIR --host 127.0.0.1 --port P --worker-id ID
--transfer auto|nixl|tcp [--metrics-port M] [--kv-cache-bytes N] [--prefill-timeout-s 60]
[--checksum] [--max-step-tokens 256]``

Loads the model, registers its KV cache as the transfer destination (the choice is logged), serves
``glmserve.decode.v1.Decode`` over gRPC (it is the prefill workers' gRPC client), prints
``READY <host>:<port>`` when it takes requests, and on SIGTERM / SIGINT drains (not ready, new
requests refused with UNAVAILABLE so routers use another worker, running ones finish for
``--drain-timeout-s``), then ends what is left with an error event (prefill workers are told)
before it exits (status 0).
``--prefill-timeout-s``: a Prefill call's deadline, and how long blocks stay reserved when a
prefill worker cannot confirm its transfer drained (the timeout both sides agree on).
``--checksum``: prefill workers stamp each transfer with a checksum that is verified here.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from glmserve.kv.transfer import make_backend
from glmserve.kv.transfer.timeouts import AGREED
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as pb_grpc
from glmserve.services.decode.prefill_client import GrpcPrefillClient
from glmserve.services.decode.servicer import DecodeServicer
from glmserve.services.decode.worker import DecodeSettings, DecodeWorker
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

# A decode worker's step computes at most this many prompt tokens (the prompts it prefills itself),
# so a long prompt runs over several steps instead of one that holds back every stream's next token
# and every command waiting for the engine thread (reservations, admissions) for its whole length.
# Not fewer: each step pays the engine's per-step work and smaller expert products again. On an AMX
# Xeon a 1,536-token prompt beside 7 decoding streams cost 1.75x / 1.38x / 1.16x the work of one
# 2,048-token step in steps of 256 / 512 / 1,024 (bench/bench_decode_step_budget.py); under the vLLM
# peer's load 1,024 gave 1.13-1.17x the output tokens/s of 256 at 512-4,096-token prompts and 0.91-0.93x
# the mean TTFT (docs/benchmarks.md).
DECODE_STEP_TOKENS = 1024


@dataclass(frozen=True)
class DecodeConfig(WorkerConfig):
    prefill_timeout_s: float = AGREED.release_s  # the agreed timeout (kv/transfer/timeouts.py)
    checksum: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_timeout_s <= 0:
            raise ValueError(f"prefill_timeout_s: must be > 0, got {self.prefill_timeout_s}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> DecodeConfig:
        p = argparse.ArgumentParser(prog="python -m glmserve.services.decode.main",
                                    description="glmserve decode worker")
        add_common_args(p)
        p.add_argument("--prefill-timeout-s", type=float, default=cls.prefill_timeout_s)
        p.add_argument("--checksum", action="store_true", help="verify a checksum of every transfer")
        p.set_defaults(max_step_tokens=DECODE_STEP_TOKENS)
        return cls(**vars(p.parse_args(argv)))


async def serve(config: DecodeConfig) -> int:
    tracing = Tracing.from_env("decode")
    publisher = start_block_events(config.kvstore, config.worker_id)
    # A receiver's transfers are bounded by the writers' timeouts; ours only matters for close().
    backend = make_backend(config.transfer, host=config.host, timeout_s=DEFAULT_TRANSFER_TIMEOUT_S)
    worker = DecodeWorker(
        lambda: build_engine(config.model, config.revision, config.engine_config(), publisher),
        backend,
        GrpcPrefillClient(tracing.client_interceptors()),
        DecodeSettings(prefill_timeout_s=config.prefill_timeout_s, checksum=config.checksum),
        metrics=lambda engine: WorkerMetrics("decode", config.worker_id, lambda: engine.snapshot),
        host_tier=config.host_tier_settings(),
    )
    servicer = DecodeServicer(worker, config.worker_id)
    return await serve_worker(config, worker, lambda server: pb_grpc.add_DecodeServicer_to_server(servicer, server),
                              worker.metrics.registry if worker.metrics is not None else None, publisher,
                              f"decode worker {config.worker_id} ({backend.kind} transfer)", role="decode",
                              tracing=tracing,
                              service=pb.DESCRIPTOR.services_by_name["Decode"].full_name)


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    return asyncio.run(serve(DecodeConfig.from_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
