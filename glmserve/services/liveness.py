"""A worker's probes over the standard gRPC health protocol (``grpc.health.v1``).

Two answers, for two kinds of probe (Kubernetes' ``grpc`` probes, ``grpc_health_probe``):

- liveness, service ``""``: this process can serve. SERVING while the event loop runs (the answer
  itself comes from it: a blocked loop does not answer, which the probe sees as a failure) and the
  engine thread is alive and not stuck (it had work, yet finished no loop iteration for
  ``stuck_after_s``). A restart is the cure for NOT_SERVING.
- readiness, service ``glmserve.<role>.v1.<Role>``: send requests here. SERVING once loaded and
  while not draining; NOT_SERVING from the first moment of a drain (routers also see ``ready`` go
  false in the worker's own Health RPC).

`HealthReporter.run` refreshes both every ``interval_s``; `EngineWatch` judges the engine thread
from its snapshots (replaced, never mutated, after every loop iteration).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

if TYPE_CHECKING:
    from glmserve.services.engine_host import EngineHost

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_STUCK_AFTER_S = 120.0  # far above one step of a long chunked prefill


class EngineWatch:
    """Whether an `EngineHost` is alive and making progress (see the module docstring)."""

    def __init__(self, engine: EngineHost, stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if stuck_after_s <= 0:
            raise ValueError(f"stuck_after_s: must be > 0, got {stuck_after_s}")
        self._engine, self._stuck_after_s, self._clock = engine, stuck_after_s, clock
        self._seen: object = None
        self._since = clock()

    def live(self) -> bool:
        snapshot, now = self._engine.snapshot, self._clock()
        if snapshot is not self._seen:
            self._seen, self._since = snapshot, now
        busy = snapshot.running + snapshot.waiting > 0
        return self._engine.alive and not (busy and now - self._since > self._stuck_after_s)


class HealthReporter:
    """Serves ``grpc.health.v1.Health`` on a worker's gRPC server (see the module docstring)."""

    def __init__(self, service: str, live: Callable[[], bool], ready: Callable[[], bool],
                 interval_s: float = 1.0) -> None:
        self.service, self._live, self._ready, self._interval_s = service, live, ready, interval_s
        self._servicer = health_aio.HealthServicer()

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    async def update(self) -> None:
        await self._servicer.set("", SERVING if self._live() else NOT_SERVING)
        await self._servicer.set(self.service, SERVING if self._ready() else NOT_SERVING)

    async def run(self) -> None:
        """Refresh the answers until cancelled."""
        while True:
            await self.update()
            await asyncio.sleep(self._interval_s)
