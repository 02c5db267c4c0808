"""A LayerSplit prefill replica for tests: one ``glmserve.services.prefill.main`` process per stage.

``Replica.launch(stages, transfer, logs)`` starts them on free ports of 127.0.0.1 (each told every
stage's address); ``ready()`` waits for each READY line; ``stage_health(k)`` is stage k's Health;
``kill(k)`` is kill -9 of stage k; ``stop()`` SIGTERMs them all and returns their exit codes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc
from worker_fixtures import (
    KV_CACHE_BYTES,
    MODEL_DIR,
    WorkerProcess,
    free_port,
    read_ready_address,
    spawn_service,
)

from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as prefill_pb
from glmserve.proto_gen.glmserve.prefill.v1 import stage_pb2_grpc


class Replica:
    def __init__(self, stages: list[WorkerProcess], addresses: list[str]) -> None:
        self.stages, self.addresses = stages, addresses

    @classmethod
    def launch(cls, num_stages: int, transfer: str, logs: Path, *extra: str, name: str = "replica",
               kv_cache_bytes: int = KV_CACHE_BYTES) -> Replica:
        addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_stages)]
        stages = []
        for k, address in enumerate(addresses):
            log = logs / f"{name}-stage{k}.log"
            cmd = [sys.executable, "-m", "glmserve.services.prefill.main", "--model", str(MODEL_DIR),
                   "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--worker-id", name,
                   "--transfer", transfer, "--kv-cache-bytes", str(kv_cache_bytes),
                   "--metrics-port", str(metrics := free_port()), "--stage-index", str(k),
                   "--stage-addresses", ",".join(addresses), *extra]
            stages.append(WorkerProcess("prefill", spawn_service(cmd, log), log, metrics))
        return cls(stages, addresses)

    @property
    def head(self) -> WorkerProcess:
        return self.stages[0]

    @property
    def address(self) -> str:
        return self.addresses[0]

    def ready(self, timeout_s: float = 120.0) -> Replica:
        """Every stage printed READY, and the head says the replica is ready (it checked the others)."""
        deadline = time.monotonic() + timeout_s
        for k, stage in enumerate(self.stages):
            if stage.address is None:
                stage.address = read_ready_address(stage.proc, stage.log, f"stage {k}", timeout_s)
        while not self.head.health().ready:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica's head did not become ready:\n{self.head.log.read_text()}")
            time.sleep(0.1)
        return self

    def stage_health(self, k: int):
        with grpc.insecure_channel(self.addresses[k]) as channel:
            return stage_pb2_grpc.StageStub(channel).Health(prefill_pb.HealthRequest(), timeout=5)

    def free_blocks(self) -> list[int]:
        return [self.stage_health(k).free_blocks for k in range(len(self.stages))]

    def running(self) -> list[int]:
        return [self.stage_health(k).running for k in range(len(self.stages))]

    def kill(self, k: int) -> None:
        self.stages[k].kill()

    def stop(self) -> list[int]:
        codes = []
        for stage in reversed(self.stages):
            codes.append(stage.stop())
        return codes
