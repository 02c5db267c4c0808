"""SIGTERM drains a worker (real processes on 127.0.0.1, driven over gRPC like the router does).

A decode worker that gets SIGTERM stops admitting (Health not ready, the grpc.health.v1 readiness
answer NOT_SERVING while liveness stays SERVING, new requests UNAVAILABLE, which the router retries
elsewhere) and lets running streams finish, greedy-exact; what the drain timeout
cuts short ends with an error event, never a broken stream. A prefill worker that gets SIGTERM
still serves what was routed to it, then exits. Every worker exits with status 0.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from worker_fixtures import HAS_MODEL, MODEL_DIR, WorkerProcess, generate, generate_request

from glmserve.core.generation import SamplingParams
from glmserve.model.greedy import greedy_generate
from glmserve.model.loader import load_model
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc
from glmserve.services.liveness import NOT_SERVING, SERVING

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")]

PROMPTS = [[11 + i, 220, 3000 + 17 * i, 45, 900 + i] * 8 for i in range(4)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _launch(role: str, tmp_path, drain_s: float) -> WorkerProcess:
    return WorkerProcess.launch(role, "tcp", tmp_path / f"{role}.log", "--drain-timeout-s", str(drain_s))


@pytest.fixture(scope="module")
def survivors(tmp_path_factory):
    """A prefill and a decode worker that stay up; each test drains a worker of its own."""
    logs = tmp_path_factory.mktemp("drain")
    pair = [_launch(role, logs, 30) for role in ("prefill", "decode")]
    yield tuple(w.ready() for w in pair)
    assert [w.stop() for w in reversed(pair)] == [0, 0]


async def _sigterm_during(decode: WorkerProcess, target: WorkerProcess, prefill: str, max_tokens: int):
    """Start every prompt on ``decode``, SIGTERM ``target`` once each stream has a token; returns the
    outcomes and what a request started right after the signal got."""
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = decode_grpc.DecodeStub(channel)
        tag = decode.log.parent.name  # request ids unique per test: the prefill worker remembers ids
        tasks = [asyncio.ensure_future(generate(stub, generate_request(f"{tag}-{i}", p, _params(max_tokens),
                                                                       prefill))) for i, p in enumerate(PROMPTS)]
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(decode.health)).running < len(PROMPTS):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks)
            await asyncio.sleep(0.01)
        target.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        late = None
        if target is decode:
            assert await _probe(channel, "") == SERVING  # alive: no restart wanted
            assert await _probe(channel, "glmserve.decode.v1.Decode") == NOT_SERVING  # send nothing here
            try:
                await generate(stub, generate_request(f"{tag}-late", PROMPTS[0], _params(4), prefill))
            except grpc.aio.AioRpcError as e:
                late = e.code()
        return await asyncio.gather(*tasks), late


async def _probe(channel: grpc.aio.Channel, service: str) -> int:
    """What a Kubernetes gRPC probe sees (grpc.health.v1)."""
    request = health_pb2.HealthCheckRequest(service=service)
    return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)).status


def test_decode_drain_lets_running_streams_finish(survivors, tmp_path) -> None:
    prefill, decode = survivors[0], _launch("decode", tmp_path, 60).ready()
    try:
        outcomes, late = asyncio.run(_sigterm_during(decode, decode, prefill.address, 40))
        assert late == grpc.StatusCode.UNAVAILABLE  # refused before any event: the router retries it
        model = load_model(MODEL_DIR)
        for prompt, out in zip(PROMPTS, outcomes, strict=True):
            assert (out.finish_reason, out.error) == ("length", "")
            assert out.tokens == greedy_generate(model, prompt, 40)
        assert decode.proc.wait(30) == 0
    finally:
        decode.kill()


def test_what_the_drain_timeout_cuts_short_ends_with_an_error_event(survivors, tmp_path) -> None:
    prefill, decode = survivors[0], _launch("decode", tmp_path, 0.5).ready()
    try:
        outcomes, _ = asyncio.run(_sigterm_during(decode, decode, prefill.address, 4000))
        for out in outcomes:
            assert out.finish_reason == "error" and "shut down" in out.error, out
            assert out.events[-1].finish_reason == "error"  # a final event, not a broken stream
        assert decode.proc.wait(30) == 0
    finally:
        decode.kill()


def test_prefill_drain_serves_what_was_routed_to_it(survivors, tmp_path) -> None:
    prefill, decode = _launch("prefill", tmp_path, 30).ready(), survivors[1]
    long = [[10 + (7 * i + j) % 7000 for j in range(900)] for i in range(3)]

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            stub = decode_grpc.DecodeStub(channel)
            one = lambda rid, p: generate(stub, generate_request(rid, p, _params(4), prefill.address))  # noqa: E731
            first = [asyncio.ensure_future(one(f"a{i}", p)) for i, p in enumerate(long)]
            await asyncio.sleep(0.05)
            prefill.proc.send_signal(signal.SIGTERM)  # while it computes the long prompts
            await asyncio.sleep(0.3)
            assert not (await asyncio.to_thread(prefill.health)).ready  # routers stop choosing it
            routed_late = await one("b", PROMPTS[1])  # a router polled before the signal: still served
            return await asyncio.gather(*first), routed_late

    try:
        outcomes, late = asyncio.run(run())
        assert all(out.finish_reason == "length" for out in [*outcomes, late]), [*outcomes, late]
        assert prefill.proc.wait(30) == 0
    finally:
        prefill.kill()
