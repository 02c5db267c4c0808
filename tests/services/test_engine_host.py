"""EngineHost: one engine thread, per-request streams of `TokenEvent`s, commands between steps,
failures that end streams instead of leaving them waiting. Driven with a scripted engine."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from glmserve.core.generation import TokenEvent
from glmserve.engine.engine_stats import EngineLoad, EngineStats
from glmserve.services.engine_host import EngineHost


class ScriptedEngine:
    """Each running request gains one token per step until it has ``length`` tokens."""

    def __init__(self, length: int = 3, fail_at_step: int | None = None) -> None:
        self.length, self.fail_at_step = length, fail_at_step
        self.requests: dict[str, int] = {}
        self.held: dict[str, str] = {}
        self.thread: str | None = None
        self.steps = 0
        self.config = SimpleNamespace(block_size=16)
        self.stats = EngineStats()
        self.stats.acceptance_lengths = Counter()
        self.cache_root = b"root"

    def add(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.requests[request_id] = 0

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[TokenEvent]:
        self.thread = threading.current_thread().name
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("kaput")
        events = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] >= self.length
            events.append(TokenEvent(rid, [self.requests[rid]], f"t{self.requests[rid]}",
                                     finish_reason="length" if done else None))
            if done:
                del self.requests[rid]
                self.held[rid] = f"kept {rid}"
        return events

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None or self.held.pop(request_id, None) is not None

    def abort_all(self) -> list[str]:
        ids = list(self.requests)
        self.requests.clear()
        return ids

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.requests), 0, len(self.held), 0, 10, 0, 10)


async def _collect(stream) -> list[TokenEvent]:
    return [e async for e in stream]


def _run(scenario, engine: ScriptedEngine):
    async def main():
        host = EngineHost(lambda: engine, "scripted")
        host.start()
        await host.loaded()
        try:
            return await asyncio.wait_for(scenario(host), 30)
        finally:
            await host.stop()

    return asyncio.run(main())


def test_streams_get_their_own_events_in_order_and_on_finish_runs_on_the_engine_thread():
    engine = ScriptedEngine(length=3)

    async def scenario(host: EngineHost):
        seen = []
        a = host.open("a", on_finish=lambda e, ev: (threading.current_thread().name, e.held[ev.request_id]))
        b = host.open("b")
        await host.submit(lambda e: (e.add("a"), e.add("b")))
        events_a, events_b = await asyncio.gather(_collect(a), _collect(b))
        seen.append(a.outcome)
        return events_a, events_b, seen, host.num_streams

    events_a, events_b, seen, open_streams = _run(scenario, engine)
    assert [e.token_ids for e in events_a] == [[1], [2], [3]] and events_a[-1].finish_reason == "length"
    assert all(e.request_id == "b" for e in events_b) and len(events_b) == 3
    assert seen == [("scripted", "kept a")] and open_streams == 0 and engine.thread == "scripted"


def test_abort_ends_the_stream_and_frees_the_request():
    engine = ScriptedEngine(length=10**6)

    async def scenario(host: EngineHost):
        stream = host.open("a")
        host.submit_nowait(lambda e: e.add("a"))
        first = await stream.next()
        host.abort("a", "client left")
        rest = await _collect(stream)
        return first, rest, await host.submit(lambda e: e.has_unfinished())

    first, rest, unfinished = _run(scenario, engine)
    assert first.token_ids == [1] and rest[-1].finish_reason == "abort" and rest[-1].error == "client left"
    assert not unfinished


def test_a_failed_step_ends_every_running_stream_with_an_error_and_keeps_serving():
    engine = ScriptedEngine(length=3, fail_at_step=2)

    async def scenario(host: EngineHost):
        a = host.open("a")
        await host.submit(lambda e: e.add("a"))
        failed = await _collect(a)
        b = host.open("b")
        await host.submit(lambda e: e.add("b"))
        return failed, await _collect(b)

    failed, later = _run(scenario, engine)
    assert failed[-1].finish_reason == "error" and "kaput" in failed[-1].error
    assert later[-1].finish_reason == "length"


def test_command_errors_reach_the_caller_and_stop_ends_open_streams():
    engine = ScriptedEngine(length=10**6)

    async def main():
        host = EngineHost(lambda: engine)
        host.start()
        await host.loaded()
        with pytest.raises(ValueError, match="request_id"):
            await host.submit(lambda e: (e.add("a"), e.add("a")))
        with pytest.raises(ValueError, match="request_id"):
            host.open("x"), host.open("x")
        stream = host.open("a")
        await stream.next()
        await host.stop()
        return await _collect(stream)

    rest = asyncio.run(main())
    assert rest[-1].finish_reason == "abort"


def test_a_load_error_surfaces_through_loaded():
    async def main():
        host = EngineHost(lambda: (_ for _ in ()).throw(OSError("no weights")))
        host.start()
        with pytest.raises(OSError, match="no weights"):
            await host.loaded()
        assert not host.is_loaded

    asyncio.run(main())
