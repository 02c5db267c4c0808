"""DisaggregatedBackend against fake decode / prefill gRPC servers (no model, no torch).

In-process fakes (same event loop as the backend) cover streaming, abort and retry; a fake in a
subprocess (this file run as a script: ``python test_router_grpc_backend.py --port 0 ...``) is
killed with SIGKILL for the worker-death test and serves the router's HTTP tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx
import pytest

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as prefill_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as prefill_grpc
from glmserve.services.router.backend import BackendUnavailable, WorkerUnreachable
from glmserve.services.router.grpc_backend import DisaggregatedBackend
from glmserve.services.router.local_prefill import LocalPrefillConfig

REPO = Path(__file__).resolve().parents[2]
TOKENS = [11, 12, 13, 14, 15]


class FakeDecode(decode_grpc.DecodeServicer):
    """Streams ``tokens`` (one per event, ``delay_s`` apart, at most max_tokens) with ``texts`` (a
    text per token, as a decode worker makes it); records requests and the request ids whose call
    was cancelled; ``fail`` refuses every Generate with that code; the first ``unprefilled`` calls
    end with ABORTED (as a decode worker whose channel to a restarted prefill worker reconnects);
    ``counting``: the tokens count on from the prompt's last id (a resumed prompt goes on where it
    stopped, as greedy decoding does)."""

    def __init__(self, tokens: list[int], delay_s: float = 0.01, free_blocks: int = 100,
                 fail: grpc.StatusCode | None = None, texts: list[str] | None = None, unprefilled: int = 0,
                 counting: bool = False):
        self.tokens, self.delay_s, self.free_blocks, self.fail = tokens, delay_s, free_blocks, fail
        self.texts = texts or [""] * len(tokens)
        self.unprefilled, self.counting = unprefilled, counting
        self.requests: list[decode_pb.GenerateRequest] = []
        self.running: set[str] = set()
        self.cancelled: list[str] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "fake refusal")
        if len(self.requests) <= self.unprefilled:
            await context.abort(grpc.StatusCode.ABORTED, "prefill worker 127.0.0.1:1 failed or is unreachable: "
                                "failed to connect to all addresses")
        rid = request.transfer.request_id
        self.running.add(rid)
        tokens, texts, cached = self.tokens, self.texts, 2
        if self.counting:  # a model that counts on from the prompt's last id
            tokens = [request.prompt_ids[-1] + 1 + i for i in range(request.sampling.max_tokens)]
            texts, cached = [""] * len(tokens), len(request.prompt_ids)
        n = min(len(tokens), request.sampling.max_tokens)
        try:
            for i, token in enumerate(tokens[:n]):
                await asyncio.sleep(self.delay_s)
                last = i == n - 1
                reason = ("length" if n == request.sampling.max_tokens else "stop") if last else ""
                yield decode_pb.GenerateEvent(
                    token_ids=[token], text=texts[i],
                    logprobs=[-0.5] if request.sampling.HasField("logprobs") else [],
                    finish_reason=reason, num_cached_tokens=cached,
                )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running.discard(rid)

    async def Health(self, request, context):
        return decode_pb.HealthReply(ready=True, worker_id="decode-fake", running=len(self.running),
                                     free_blocks=self.free_blocks)


class FakePrefill(prefill_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.ready = True

    async def Health(self, request, context):
        return prefill_pb.HealthReply(ready=self.ready, worker_id="prefill-fake", free_blocks=100)


async def start_fake(decode: FakeDecode | None = None, prefill: FakePrefill | None = None,
                     port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    if decode is not None:
        decode_grpc.add_DecodeServicer_to_server(decode, server)
    if prefill is not None:
        prefill_grpc.add_PrefillServicer_to_server(prefill, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def healthy(backend: DisaggregatedBackend, address: str, kind: str = "decode") -> bool:
    return any(k == kind and v.address == address and v.healthy for k, v in backend.workers())


async def collect(stream) -> list[TokenEvent]:
    return [event async for event in stream]


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 30))


def test_streams_events_and_sends_the_request_contract() -> None:
    async def scenario() -> None:
        decode, prefill = FakeDecode(TOKENS), FakePrefill()
        d_server, d_addr = await start_fake(decode=decode)
        p_server, p_addr = await start_fake(prefill=prefill)
        backend = DisaggregatedBackend([d_addr], [p_addr], poll_interval_s=0.05)
        assert not backend.ready()  # no Health answer yet
        await backend.start()
        await eventually(backend.ready)
        params = SamplingParams(max_tokens=3, temperature=0.0, seed=2**64 - 1, stop=("x",), logprobs=1)
        events = await collect(backend.generate("r1", [5, 6, 7], params))
        assert [e.token_ids for e in events] == [[11], [12], [13]]
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert all(e.logprobs == [-0.5] and e.num_cached_tokens == 2 for e in events)
        assert not any(e.finished for e in events[:-1])
        sent = decode.requests[0]
        assert sent.transfer.request_id == "r1" and sent.transfer.generation >= 1
        assert list(sent.prompt_ids) == [5, 6, 7] and sent.prefill_target == p_addr
        assert sent.sampling.seed == -1 and list(sent.sampling.stop) == ["x"] and sent.sampling.logprobs == 1
        await collect(backend.generate("r2", [1], SamplingParams(max_tokens=1)))
        assert decode.requests[1].transfer.generation > sent.transfer.generation
        assert not decode.requests[1].sampling.HasField("seed")
        counts = {"prefill": {"healthy": 1, "total": 1}, "decode": {"healthy": 1, "total": 1}}
        assert backend.readiness_detail()["workers"] == counts
        prefill.ready = False  # a worker that says "not ready" is not chosen
        await eventually(lambda: not backend.ready())
        assert backend.readiness_detail()["workers"]["prefill"] == {"healthy": 0, "total": 1}
        with pytest.raises(BackendUnavailable):
            await collect(backend.generate("r3", [1], SamplingParams(max_tokens=1)))
        await backend.close()
        assert not backend.ready()
        await d_server.stop(None)
        await p_server.stop(None)

    run(scenario)


@pytest.mark.parametrize("mode", ["auto", "off", "always"])
def test_local_prefill_under_a_prefill_backlog(mode: str) -> None:
    """auto: the first prompt goes to the prefill worker; while it is being prefilled (until its
    first event) the next equal one is cheaper on the decode worker, and so on, alternating. Every
    stream is the same; the counts and the router's queued tokens add up."""
    async def scenario() -> None:
        decode = FakeDecode(TOKENS, delay_s=0.2)
        server, addr = await start_fake(decode=decode, prefill=FakePrefill())
        backend = DisaggregatedBackend([addr], [addr], poll_interval_s=0.05, local_prefill=LocalPrefillConfig(mode))
        await backend.start()
        await eventually(backend.ready)
        streams = [asyncio.create_task(collect(backend.generate(f"r{i}", [1] * 100, SamplingParams(max_tokens=2))))
                   for i in range(4)]
        outs = await asyncio.gather(*streams)
        assert all([e.token_ids for e in out] == [[11], [12]] for out in outs)
        local = {r.transfer.request_id for r in decode.requests if r.prefill_locally}
        assert all(r.prefill_target == addr for r in decode.requests)
        assert local == {"auto": {"r1", "r3"}, "off": set(), "always": {"r0", "r1", "r2", "r3"}}[mode]
        counted = backend.prefix_router.metrics.local_prefills
        assert sum(counted.labels(reason=r)._value.get() for r in ("backlog", "always")) == len(local)
        assert backend.local_prefill.queued(addr) == 0 and backend.prefix_router.queued_tokens(addr) == 0
        await backend.close()
        await server.stop(None)

    run(scenario)


def test_abort_and_early_close_cancel_the_call() -> None:
    async def scenario() -> None:
        decode = FakeDecode(list(range(100, 200)), delay_s=0.05)
        server, addr = await start_fake(decode=decode, prefill=FakePrefill())
        backend = DisaggregatedBackend([addr], [addr], poll_interval_s=0.05)
        await backend.start()
        await eventually(backend.ready)
        params = SamplingParams(max_tokens=100)
        stream = backend.generate("a1", [1, 2], params)
        first = await anext(stream)
        assert first.token_ids == [100]
        start = time.monotonic()
        await backend.abort("a1")
        rest = await collect(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert time.monotonic() - start < 0.5
        await eventually(lambda: "a1" in decode.cancelled)
        await backend.abort("a1")  # idempotent, also for unknown ids
        await backend.abort("never-ran")

        stream = backend.generate("a2", [1], params)
        await anext(stream)
        await stream.aclose()  # the consumer left: the backend cancels by itself
        await eventually(lambda: "a2" in decode.cancelled and not decode.running)
        assert all(v.inflight == 0 for _, v in backend.workers())

        stream = backend.generate("a3", [1], params)  # open streams end with "abort" on close
        await anext(stream)
        await backend.close()
        assert (await collect(stream))[-1].finish_reason == "abort"
        await server.stop(None)

    run(scenario)


def test_refused_before_the_first_event_retries_elsewhere_with_a_new_generation() -> None:
    async def scenario() -> None:
        refusing = FakeDecode(TOKENS, free_blocks=500, fail=grpc.StatusCode.UNAVAILABLE)
        good = FakeDecode(TOKENS, free_blocks=100)
        s1, refusing_addr = await start_fake(decode=refusing, prefill=FakePrefill())
        s2, good_addr = await start_fake(decode=good)
        backend = DisaggregatedBackend([refusing_addr, good_addr], [refusing_addr], poll_interval_s=0.05)
        await backend.start()
        await eventually(lambda: healthy(backend, refusing_addr) and healthy(backend, good_addr))
        events = await collect(backend.generate("t1", [1], SamplingParams(max_tokens=2)))
        assert [e.token_ids for e in events] == [[11], [12]]
        assert len(refusing.requests) == 1 and len(good.requests) == 1  # more free blocks: tried first
        assert good.requests[0].transfer.generation > refusing.requests[0].transfer.generation
        # Its Health still answers ready, so it is chosen again after the next poll.
        await eventually(lambda: healthy(backend, refusing_addr))
        await s2.stop(None)  # now every decode worker refuses: 503, not an error stream
        await eventually(lambda: not healthy(backend, good_addr))
        with pytest.raises(BackendUnavailable):
            await collect(backend.generate("t2", [1], SamplingParams(max_tokens=2)))
        await backend.close()
        await s1.stop(None)

    run(scenario)


def test_a_decode_worker_that_could_not_reach_prefill_is_tried_again_not_failed() -> None:
    async def scenario() -> None:
        decode = FakeDecode(TOKENS, unprefilled=2)
        server, addr = await start_fake(decode=decode, prefill=FakePrefill())
        backend = DisaggregatedBackend([addr], [addr], poll_interval_s=0.05)
        await backend.start()
        await eventually(backend.ready)
        for _ in range(2):  # nothing was generated: "try again in a moment", not an error event
            with pytest.raises(WorkerUnreachable):
                await collect(backend.generate("u1", [1], SamplingParams(max_tokens=2)))
            assert healthy(backend, addr)  # the decode worker is not at fault
        events = await collect(backend.generate("u1", [1], SamplingParams(max_tokens=2)))
        assert [e.token_ids for e in events] == [[11], [12]]
        await backend.close()
        await server.stop(None)

    run(scenario)


async def _stream_through_a_death(migration_limit: int) -> tuple[list[TokenEvent], FakeDecode]:
    """A 40-token stream from a counting fake, whose server stops after 5 tokens; another counting
    fake stays. Returns the stream's events and the one that stayed."""
    doomed, staying = FakeDecode([], delay_s=0.02, free_blocks=500, counting=True), FakeDecode([], counting=True)
    s1, doomed_addr = await start_fake(decode=doomed)
    s2, staying_addr = await start_fake(decode=staying, prefill=FakePrefill())
    backend = DisaggregatedBackend([doomed_addr, staying_addr], [staying_addr], poll_interval_s=0.05,
                                   migration_limit=migration_limit)
    await backend.start()
    await eventually(lambda: healthy(backend, doomed_addr) and healthy(backend, staying_addr))
    stream = backend.generate("m1", [7, 1000], SamplingParams(max_tokens=40, temperature=0.0, logprobs=0))
    events = [await anext(stream) for _ in range(5)]  # on the doomed one: more free blocks
    await s1.stop(None)  # its calls end at once: as a killed worker's
    events += await collect(stream)
    await backend.close()
    await s2.stop(None)
    return events, staying


def test_a_stream_whose_decode_worker_dies_resumes_on_another() -> None:
    async def scenario() -> None:
        events, staying = await _stream_through_a_death(migration_limit=3)
        assert [t for e in events for t in e.token_ids] == list(range(1001, 1041))  # as in one run
        assert events[-1].finish_reason == "length" and not any(e.error for e in events)
        assert all(e.num_cached_tokens == 2 and e.logprobs == [-0.5] for e in events)  # the first attempt's
        resumed = staying.requests[0]
        n = len(resumed.prompt_ids) - 2
        assert list(resumed.prompt_ids) == [7, 1000, *range(1001, 1001 + n)] and n >= 5
        assert (resumed.sampling.max_tokens, resumed.sampling.num_resumed) == (40 - n, n)

    run(scenario)


def test_without_migration_a_dead_decode_worker_ends_the_stream_with_an_error() -> None:
    async def scenario() -> None:
        events, staying = await _stream_through_a_death(migration_limit=0)
        assert events[-1].finish_reason == "error" and "decode worker" in events[-1].error
        tokens = [t for e in events for t in e.token_ids]
        assert 5 <= len(tokens) < 40 and tokens == list(range(1001, 1001 + len(tokens))) and not staying.requests

    run(scenario)


# --- a fake worker in its own process --------------------------------------------------------------


def start_fake_process(port: int = 0, tokens: list[int] = TOKENS, delay_s: float = 0.01,
                       free_blocks: int = 100, with_text: bool = False,
                       unprefilled: int = 0) -> tuple[subprocess.Popen[str], str]:
    """This file as a script: a fake decode + prefill server; returns (process, host:port).
    ``with_text``: events carry the tokens' text (the bundled model's tokenizer)."""
    cmd = [sys.executable, __file__, "--port", str(port), "--tokens", ",".join(map(str, tokens)),
           "--delay", str(delay_s), "--free-blocks", str(free_blocks), "--unprefilled", str(unprefilled),
           *(["--with-text"] if with_text else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = proc.stdout.readline()
    assert line.startswith("READY "), f"fake worker did not start: {line!r}"
    return proc, line.split()[1]


def stop_process(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_decode_death_mid_stream_errors_promptly_then_recovers() -> None:
    doomed, doomed_addr = start_fake_process(tokens=list(range(100, 400)), delay_s=0.02, free_blocks=500)
    other, other_addr = start_fake_process(free_blocks=100)
    try:
        async def scenario() -> None:
            backend = DisaggregatedBackend([doomed_addr, other_addr], [other_addr], poll_interval_s=0.1,
                                           migration_limit=0)  # the stream is not resumed elsewhere
            await backend.start()
            await eventually(lambda: healthy(backend, doomed_addr) and healthy(backend, other_addr))
            stream = backend.generate("k1", [1], SamplingParams(max_tokens=300))
            assert (await anext(stream)).token_ids == [100]  # on the doomed worker: more free blocks
            os.kill(doomed.pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = await collect(stream)
            assert rest[-1].finished and rest[-1].finish_reason == "error" and rest[-1].error
            assert time.monotonic() - killed < 2.0
            assert not healthy(backend, doomed_addr) and backend.ready()
            # New requests go to the remaining worker, repeatedly.
            for i in range(3):
                events = await collect(backend.generate(f"k2-{i}", [1], SamplingParams(max_tokens=2)))
                assert events[-1].finish_reason == "length"
            # A worker back on the same address is used again once its Health answers.
            revived, _ = start_fake_process(port=int(doomed_addr.rsplit(":", 1)[1]), free_blocks=500)
            try:
                await eventually(lambda: healthy(backend, doomed_addr), timeout_s=10)
                events = await collect(backend.generate("k3", [1], SamplingParams(max_tokens=2)))
                assert [e.token_ids for e in events] == [[11], [12]]
            finally:
                stop_process(revived)
            await backend.close()

        run(scenario)
    finally:
        stop_process(doomed)
        stop_process(other)


# --- through the router's HTTP API ------------------------------------------------------------------


def _app(backend: DisaggregatedBackend):
    from router_fixtures import MODEL_DIR

    from glmserve.services.router.app import create_app
    from glmserve.text.tokenizer import Tokenizer

    return create_app(backend, Tokenizer.from_dir(MODEL_DIR), "glm52-tiny", max_context=4096)


def test_router_answers_503_when_no_worker_is_ready() -> None:
    from router_fixtures import free_port, serve

    dead = f"127.0.0.1:{free_port()}"
    with serve(_app(DisaggregatedBackend([dead], [dead], poll_interval_s=0.1)), ready_path=None) as base:
        assert httpx.get(f"{base}/ready").status_code == 503
        body = {"model": "glm52-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 503 and "retry-after" in r.headers
        assert r.json()["error"]["type"]


def test_router_streams_through_a_worker_and_reports_its_death_as_an_sse_error() -> None:
    from router_fixtures import MODEL_DIR, serve

    from glmserve.text.tokenizer import Tokenizer

    tokens = Tokenizer.from_dir(MODEL_DIR).encode(" hello there" * 40)
    proc, addr = start_fake_process(tokens=tokens, delay_s=0.02, with_text=True)
    try:
        with serve(_app(DisaggregatedBackend([addr], [addr], poll_interval_s=0.1))) as base:
            body = {"model": "glm52-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"].startswith(" hello")
            assert r.json()["usage"]["completion_tokens"] == 4
            body = {**body, "max_tokens": len(tokens), "stream": True}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=10) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                proc.kill()
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert "decode worker" in error["message"] and error["type"], error  # an OpenAI error object
            # The only worker is gone: the router stops taking requests (503) instead of failing them.
            deadline = time.monotonic() + 5
            while httpx.get(f"{base}/ready", timeout=5).status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        stop_process(proc)


def test_a_worker_restarting_behind_its_address_is_a_wait_or_a_503_never_a_500() -> None:
    """Requests sent while the only worker is down, while it comes back on the same port and while
    its first calls cannot be prefilled (ABORTED): each answer is a 200 or a 503 with Retry-After."""
    from router_fixtures import MODEL_DIR, serve

    from glmserve.text.tokenizer import Tokenizer

    tokens = Tokenizer.from_dir(MODEL_DIR).encode(" hello there")
    proc, addr = start_fake_process(tokens=tokens, with_text=True)
    body = {"model": "glm52-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    statuses: list[int] = []

    def ask() -> int:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"]
        else:
            assert r.json()["choices"][0]["message"]["content"] == " hello there"
        statuses.append(r.status_code)
        return r.status_code

    try:
        with serve(_app(DisaggregatedBackend([addr], [addr], poll_interval_s=0.1))) as base:
            assert ask() == 200
            stop_process(proc)
            deadline = time.monotonic() + 5
            while ask() != 503:  # the router has seen it go
                assert time.monotonic() < deadline
            port = int(addr.rsplit(":", 1)[1])
            proc, _ = start_fake_process(port=port, tokens=tokens, with_text=True, unprefilled=3)
            deadline = time.monotonic() + 10
            while ask() != 200:
                assert time.monotonic() < deadline
            assert all(ask() == 200 for _ in range(3))
    finally:
        stop_process(proc)
    assert 500 not in statuses


async def _serve_fake(args: argparse.Namespace) -> None:
    tokens = [int(t) for t in args.tokens.split(",") if t]
    from router_fixtures import MODEL_DIR

    from glmserve.text.tokenizer import Tokenizer

    texts = [Tokenizer.from_dir(MODEL_DIR).decode([t]) for t in tokens] if args.with_text else None
    decode = FakeDecode(tokens, delay_s=args.delay, free_blocks=args.free_blocks, texts=texts,
                        unprefilled=args.unprefilled)
    server, address = await start_fake(decode=decode, prefill=FakePrefill(), port=args.port)
    print(f"READY {address}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a fake decode + prefill worker for these tests")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--delay", type=float, default=0.01)
    parser.add_argument("--free-blocks", type=int, default=100)
    parser.add_argument("--with-text", action="store_true")
    parser.add_argument("--unprefilled", type=int, default=0)
    asyncio.run(_serve_fake(parser.parse_args()))
