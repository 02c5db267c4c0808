"""kill -9 of a worker under load, through the whole stack: the router, prefill and decode workers
as real processes on 127.0.0.1 and the unmodified `openai` client, streaming.

A killed decode worker's streams resume on the other decode worker (stream migration) and finish
with exactly the text of an unloaded run (greedy); with ``--migration-limit 0`` they get an error
(an SSE error event, raised by the client as `openai.APIError`) within seconds, not a hang, while
the other clients finish as unloaded. Requests a killed prefill worker was computing are tried
again on the other prefill worker (nothing was generated yet), and finish as unloaded. New requests
succeed on the workers left.
KV moves over NIXL where it imports (the deployment default), else TCP; a prefill worker killed
mid-write over each transfer kind is covered worker-level in test_workers_disaggregated.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from router_process import RouterProcess
from worker_fixtures import HAS_MODEL, MODEL_DIR, WorkerProcess

from glmserve.kv.transfer import nixl_unavailable_reason

TRANSFER = "tcp" if nixl_unavailable_reason() is not None else "nixl"
PROMPT_ERROR_S = 5.0  # the affected streams must end this soon after the kill

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")]


@pytest.fixture(scope="module")
def survivors(tmp_path_factory) -> Iterator[tuple[str, WorkerProcess, WorkerProcess]]:
    """The prefill and decode worker that stay up; each test adds a doomed one and a router."""
    kind, logs = TRANSFER, tmp_path_factory.mktemp(f"death-{TRANSFER}")
    prefill = WorkerProcess.launch("prefill", kind, logs / "prefill.log")
    decode = WorkerProcess.launch("decode", kind, logs / "decode.log")
    try:
        prefill.ready(), decode.ready()
        yield kind, prefill, decode
    finally:
        codes = [w.stop() for w in (decode, prefill)]
    assert codes == [0, 0], "a surviving worker did not exit cleanly on SIGTERM"


@dataclass
class Result:
    """What one streamed request saw."""

    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: openai.APIError | None = None
    ended_at: float = 0.0


Request = Callable[[openai.AsyncOpenAI], Awaitable[object]]


async def _stream(client: openai.AsyncOpenAI, request: Request, out: Result | None = None) -> Result:
    """Run one streamed request to its end, filling ``out`` as chunks come (others may watch it)."""
    out = out if out is not None else Result()
    try:
        async for chunk in await request(client):
            if chunk.choices:
                choice = chunk.choices[0]
                out.text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
                out.finish_reason = choice.finish_reason or out.finish_reason
                out.chunks += 1
    except openai.APIError as e:
        out.error = e
    out.ended_at = time.monotonic()
    return out


def _chat(content: str, max_tokens: int) -> Request:
    def call(client: openai.AsyncOpenAI) -> Awaitable[object]:
        return client.chat.completions.create(
            model=MODEL_DIR.name, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
    return call


def _completion(prompt: list[int], max_tokens: int) -> Request:
    def call(client: openai.AsyncOpenAI) -> Awaitable[object]:
        return client.completions.create(model=MODEL_DIR.name, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    return call


async def _kill_during(router: RouterProcess, requests: list[Request], doomed: WorkerProcess,
                       when: Callable[[list[Result]], bool]) -> tuple[list[Result], float]:
    """Run ``requests`` at once; kill -9 ``doomed`` as soon as ``when(partial results)`` and it has
    a request running. Returns the results and the kill time."""
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
    partial = [Result() for _ in requests]

    async with client:
        tasks = [asyncio.ensure_future(_stream(client, r, out)) for r, out in zip(requests, partial, strict=True)]
        deadline = time.monotonic() + 60
        while not (when(partial) and (await asyncio.to_thread(doomed.health)).running > 0):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), \
                f"the doomed {doomed.role} worker never got a request: {partial}"
            await asyncio.sleep(0.02)
        doomed.kill()
        killed = time.monotonic()
        return await asyncio.gather(*tasks), killed


async def _solo(router: RouterProcess, requests: list[Request]) -> list[Result]:
    """The requests one after another on the idle platform: the unloaded reference (greedy)."""
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
    async with client:
        return [await _stream(client, r) for r in requests]


def _check(results: list[Result], killed: float, reference: list[Result]) -> None:
    failed = [r for r in results if r.error is not None]
    assert failed, "no stream was on the killed worker"
    assert len(failed) < len(results), "every stream failed, not only the killed worker's"
    for r in failed:
        assert r.ended_at - killed < PROMPT_ERROR_S, f"an error came {r.ended_at - killed:.1f}s after the kill"
        assert r.error.message  # the client raised the SSE error event as APIError with its message
    for r, ref in zip(results, reference, strict=True):
        assert ref.error is None and ref.finish_reason == "length", f"a request after the kill failed: {ref}"
        if r.error is None:
            assert (r.finish_reason, r.text) == ("length", ref.text)


def _check_all_served(results: list[Result], reference: list[Result]) -> None:
    for r, ref in zip(results, reference, strict=True):
        assert ref.error is None and ref.finish_reason == "length", f"a request after the kill failed: {ref}"
        assert (r.error, r.finish_reason, r.text) == (None, "length", ref.text)


@pytest.fixture
def launched(tmp_path: Path):
    """Starts processes for one test and stops (or kills) every one of them at the end."""
    procs: list[WorkerProcess | RouterProcess] = []

    def start(proc):
        procs.append(proc)
        return proc

    yield start
    for proc in reversed(procs):
        proc.kill()


@pytest.mark.parametrize("migration", ["on", "off"])
def test_decode_worker_killed_while_streaming(survivors, launched, tmp_path: Path, migration: str):
    kind, prefill, decode = survivors
    free = decode.health().free_blocks
    doomed = launched(WorkerProcess.launch("decode", kind, tmp_path / "doomed-decode.log")).ready()
    router = launched(RouterProcess.launch(tmp_path / "router.log", [prefill.address],
                                           [decode.address, doomed.address], None,
                                           *(["--migration-limit", "0"] if migration == "off" else [])))
    time.sleep(0.5)  # two health polls: both decode workers are chosen, not only the first ready one
    requests = [_chat(f"Explain item {i} of the list in json/decoder.py.", 150) for i in range(6)]
    # Kill once every client streams: the doomed worker's clients are mid-stream.
    results, killed = asyncio.run(_kill_during(router, requests, doomed, lambda rs: all(r.chunks for r in rs)))
    assert all(r.chunks > 1 for r in results if r.error is not None)  # they were streaming
    reference = asyncio.run(_solo(router, requests))
    if migration == "on":  # nobody failed: the doomed worker's streams went on on the other one
        _check_all_served(results, reference)
        assert "resuming after" in (tmp_path / "router.log").read_text()
    else:
        _check(results, killed, reference)
    h = decode.wait_free(free)
    assert (h.free_blocks, h.running) == (free, 0)


def test_prefill_worker_killed_during_prefill(survivors, launched, tmp_path: Path):
    kind, prefill, decode = survivors
    free = decode.health().free_blocks
    doomed = launched(WorkerProcess.launch("prefill", kind, tmp_path / "doomed-prefill.log")).ready()
    router = launched(RouterProcess.launch(tmp_path / "router.log", [prefill.address, doomed.address],
                                           [decode.address], None))
    time.sleep(0.5)  # two health polls: both prefill workers are chosen
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randrange(1100, 1400))] for _ in range(4)]
    requests = [_completion(p, 12) for p in prompts]
    # Kill while the doomed worker computes a long prompt: no client has a token yet, so its
    # requests are tried again (on the other prefill worker) and nobody fails.
    results, _ = asyncio.run(_kill_during(router, requests, doomed, lambda rs: True))
    _check_all_served(results, asyncio.run(_solo(router, requests)))
    h = decode.wait_free(free)  # the dead writer's blocks come back after decode's grace period
    assert (h.free_blocks, h.running, h.ready) == (free, 0, True)
