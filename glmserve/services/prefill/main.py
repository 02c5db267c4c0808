"""The prefill worker process:

``python -m glmserve.services.prefill.main --model DIR --host 127.0.0.1 --port P --worker-id ID
--transfer auto|nixl|tcp [--metrics-port M] [--kv-cache-bytes N] [--transfer-timeout-s S]``

Loads the model, registers its KV cache with the transfer backend (the choice is logged), serves
``glmserve.prefill.v1.Prefill`` over gRPC, prints ``READY <host>:<port>`` when it takes requests, and
on SIGTERM / SIGINT drains (not ready; what was routed here is still served, for up to
``--drain-timeout-s``), then aborts what is left and drains its transfers before it exits (status 0).
``--transfer-timeout-s``: a write still running after this is failed and fenced; keep it, plus the
5 s drain, below the decode workers' ``--prefill-timeout-s`` (the timeout both sides agree on).

LayerSplit: ``--stage-index K --stage-addresses A0,A1,... [--layer-split 0-3,4-7]`` makes this
process stage K of a replica of as many stages as addresses (see `stage_process`); stage 0 is
the replica's prefill worker. ``--chunk-tokens``: the pipelined chunk; ``--stream-min-tokens``:
prompts with fewer tokens to compute write their KV once per stage instead of after every chunk.
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
from glmserve.services.prefill.stage_job import DEFAULT_STREAM_MIN_TOKENS
from glmserve.services.prefill.stage_process import serve_stage
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
    stage_index: int | None = None  # LayerSplit: this process is stage K of a replica
    stage_addresses: str | None = None  # host:port of every stage, in order
    layer_split: str | None = None  # explicit split, e.g. 0-3,4-7 (else the planner's)
    chunk_tokens: int = 2048
    stream_min_tokens: int = DEFAULT_STREAM_MIN_TOKENS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: must be > 0, got {self.transfer_timeout_s}")
        if self.chunk_tokens < 1 or self.stream_min_tokens < 0:
            raise ValueError("chunk_tokens: must be >= 1 (and stream_min_tokens >= 0)")
        if (self.stage_index is None) != (self.stage_addresses is None):
            raise ValueError("stage_index: --stage-index and --stage-addresses go together")
        if self.stage_addresses is not None:
            addresses = self.stage_address_list
            if not 0 <= self.stage_index < len(addresses):
                raise ValueError(f"stage_index: {self.stage_index} is not one of the {len(addresses)} stages")
            if not addresses[self.stage_index].endswith(f":{self.port}"):  # its name there may differ (DNS)
                raise ValueError(f"stage_addresses: stage {self.stage_index} is {addresses[self.stage_index]}, "
                                 f"but this process listens on port {self.port}")

    @property
    def stage_address_list(self) -> list[str]:
        return [a.strip() for a in (self.stage_addresses or "").split(",") if a.strip()]

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> PrefillConfig:
        p = argparse.ArgumentParser(prog="python -m glmserve.services.prefill.main",
                                    description="glmserve prefill worker")
        add_common_args(p)
        p.add_argument("--transfer-timeout-s", type=float, default=DEFAULT_TRANSFER_TIMEOUT_S)
        p.add_argument("--stage-index", type=int, default=None, help="LayerSplit: this process is stage K")
        p.add_argument("--stage-addresses", default=None, help="LayerSplit: host:port of every stage, in order")
        p.add_argument("--layer-split", default=None, help="LayerSplit: explicit ranges, e.g. 0-3,4-7")
        p.add_argument("--chunk-tokens", type=int, default=cls.chunk_tokens, help="pipelined prefill chunk")
        p.add_argument("--stream-min-tokens", type=int, default=DEFAULT_STREAM_MIN_TOKENS,
                       help="LayerSplit: below this many tokens to compute, each stage writes its KV once")
        return cls(**vars(p.parse_args(argv)))


async def serve(config: PrefillConfig) -> int:
    if config.stage_index is not None:
        return await serve_stage(config)
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
