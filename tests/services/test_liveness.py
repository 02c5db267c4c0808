"""Liveness and readiness over grpc.health.v1: EngineWatch's verdicts, and HealthReporter's
answers through a real gRPC server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from glmserve.services.engine_snapshot import EngineSnapshot
from glmserve.services.liveness import NOT_SERVING, SERVING, EngineWatch, HealthReporter


@dataclass
class FakeEngine:
    snapshot: EngineSnapshot
    alive: bool = True


def test_an_engine_with_work_and_no_progress_is_stuck() -> None:
    now = [0.0]
    engine = FakeEngine(EngineSnapshot(loaded=True))
    watch = EngineWatch(engine, stuck_after_s=10, clock=lambda: now[0])
    now[0] = 100.0
    assert watch.live()  # idle for long: blocked on its command queue, which is fine
    engine.snapshot = EngineSnapshot(loaded=True, running=2)
    assert watch.live()
    now[0] = 105.0
    engine.snapshot = EngineSnapshot(loaded=True, running=2)  # a new snapshot: it made progress
    assert watch.live()
    now[0] = 116.0  # the same snapshot for 11 s while requests run
    assert not watch.live()
    engine.snapshot = EngineSnapshot(loaded=True, running=1)
    assert watch.live()
    engine.alive = False
    assert not watch.live()


def test_the_reporter_answers_liveness_and_readiness() -> None:
    state = {"live": True, "ready": False}

    async def run() -> list[tuple[str, int]]:
        reporter = HealthReporter("glmserve.decode.v1.Decode", lambda: state["live"], lambda: state["ready"])
        server = grpc.aio.server()
        reporter.add_to(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def check() -> None:
                    await reporter.update()
                    for service in ("", reporter.service):
                        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                        seen.append((service, reply.status))

                await check()
                state["ready"] = True
                await check()
                state["live"] = False
                await check()
        finally:
            await server.stop(0)
        return seen

    svc = "glmserve.decode.v1.Decode"
    assert asyncio.run(run()) == [("", SERVING), (svc, NOT_SERVING), ("", SERVING), (svc, SERVING),
                                  ("", NOT_SERVING), (svc, SERVING)]
