"""AdmissionQueue: order (priority, then arrival), bounds (length, per tenant, wait), a client
that leaves, drain, a request that waits again after finding every worker full, and the metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from glmserve.services.router.admission import AdmissionConfig, AdmissionQueue, ClientGone, Rejected
from glmserve.services.router.admission_metrics import AdmissionMetrics
from glmserve.services.router.metrics import RouterMetrics


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def make(**config) -> tuple[AdmissionQueue, CollectorRegistry]:
    router = RouterMetrics("m")
    return AdmissionQueue(AdmissionConfig(**config), AdmissionMetrics(router.registry, router.rejected)), router.registry


def rejections(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("glmserve_router_rejections_total", {"reason": reason})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_priority_then_arrival_order() -> None:
    async def scenario() -> list[str]:
        q, _ = make(max_running=1)
        first = await q.admit("t", 0, asyncio.Event())
        order: list[str] = []

        async def one(name: str, priority: int) -> None:
            ticket = await q.admit("t", priority, asyncio.Event())
            order.append(name)
            await asyncio.sleep(0)
            ticket.release()

        tasks = []
        for name, priority in (("late-low", 5), ("a", 0), ("b", 0), ("urgent", -1)):
            tasks.append(asyncio.create_task(one(name, priority)))
            await settle()
        assert (q.running, q.queued) == (1, 4)
        first.release()
        await asyncio.gather(*tasks)
        assert (q.running, q.queued) == (0, 0)
        return order

    assert run(scenario()) == ["urgent", "a", "b", "late-low"]


def test_bounds_answer_429_with_their_reason() -> None:
    async def scenario() -> None:
        q, registry = make(max_running=1, max_queued=3, max_queued_per_tenant=2, retry_after_s=2)
        await q.admit("a", 0, asyncio.Event())
        waiting = [asyncio.create_task(q.admit(t, 0, asyncio.Event())) for t in ("a", "a", "b")]
        await settle()
        with pytest.raises(Rejected) as full:
            await q.admit("c", 0, asyncio.Event())
        assert (full.value.status, full.value.reason, full.value.retry_after_s) == (429, "queue_full", 2)
        waiting[2].cancel()  # b's task gives up: its place is free again
        await settle()
        with pytest.raises(Rejected) as capped:
            await q.admit("a", 0, asyncio.Event())  # a already has 2 queued
        assert (capped.value.status, capped.value.reason) == (429, "tenant_cap")
        other = asyncio.create_task(q.admit("c", 0, asyncio.Event()))  # another tenant still fits
        await settle()
        assert q.queued == 3
        assert rejections(registry, "queue_full") == rejections(registry, "tenant_cap") == 1
        for t in (*waiting[:2], other):
            t.cancel()
        await asyncio.gather(*waiting, other, return_exceptions=True)

    run(scenario())


def test_a_queued_request_times_out_and_a_gone_client_is_dropped_at_once() -> None:
    async def scenario() -> None:
        q, registry = make(max_running=1, max_wait_s=0.2)
        held = await q.admit("t", 0, asyncio.Event())
        with pytest.raises(Rejected) as late:
            await q.admit("t", 0, asyncio.Event())
        assert (late.value.status, late.value.reason) == (429, "queue_timeout")
        gone = asyncio.Event()
        waiting = asyncio.create_task(q.admit("t", 0, gone))
        await settle()
        assert q.queued == 1
        gone.set()
        with pytest.raises(ClientGone):
            await waiting
        assert q.queued == 0 and rejections(registry, "gone") == 1
        held.release()
        assert q.running == 0  # nobody was granted the slot on the gone client's behalf
        assert registry.get_sample_value("glmserve_router_queue_wait_seconds_count") == 2

    run(scenario())


def test_drain_refuses_queued_and_new_requests_with_503() -> None:
    async def scenario() -> None:
        q, registry = make(max_running=1)
        running = await q.admit("t", 0, asyncio.Event())
        waiting = asyncio.create_task(q.admit("t", 0, asyncio.Event()))
        await settle()
        q.drain()
        with pytest.raises(Rejected) as queued:
            await waiting
        with pytest.raises(Rejected) as new:
            await q.admit("t", 0, asyncio.Event())
        assert (queued.value.status, new.value.status, new.value.reason) == (503, 503, "draining")
        assert rejections(registry, "draining") == 2
        running.release()  # what runs goes on to its end

    run(scenario())


def test_a_request_that_found_every_worker_full_waits_for_one_to_end() -> None:
    async def scenario() -> None:
        q, registry = make(max_running=4, capacity_poll_s=5.0, max_wait_s=0.5)
        other = await q.admit("t", 0, asyncio.Event())
        mine = await q.admit("t", 0, asyncio.Event())
        loop = asyncio.get_running_loop()
        start = loop.time()
        waiting = asyncio.create_task(mine.wait_for_capacity(asyncio.Event()))
        await asyncio.sleep(0.05)
        assert not waiting.done() and q.running == 2  # it keeps its slot meanwhile
        other.release()  # a request ended: try again now, not after capacity_poll_s
        await waiting
        assert loop.time() - start < 1.0
        await asyncio.sleep(0.5)  # past its first arrival's deadline
        with pytest.raises(Rejected) as late:
            await mine.wait_for_capacity(asyncio.Event())
        assert late.value.reason == "queue_timeout" and rejections(registry, "queue_timeout") == 1
        mine.release()

    run(scenario())


def test_a_request_whose_workers_were_unreachable_tries_again_until_its_deadline() -> None:
    async def scenario() -> None:
        q, registry = make(retry_poll_s=0.05, max_wait_s=0.3)
        ticket = await q.admit("t", 0, asyncio.Event())
        loop = asyncio.get_running_loop()
        start, tries = loop.time(), 0
        while await ticket.wait_to_retry(asyncio.Event()):  # keeping its slot
            tries += 1
            assert q.running == 1
        assert 0.25 < loop.time() - start < 1.0 and tries >= 3
        assert rejections(registry, "queue_timeout") == 0  # the caller answers 503, not a queue 429
        gone = asyncio.Event()
        gone.set()
        other = await q.admit("t", 0, asyncio.Event())
        with pytest.raises(ClientGone):
            await other.wait_to_retry(gone)
        q.drain()
        with pytest.raises(Rejected) as refused:
            await other.wait_to_retry(asyncio.Event())
        assert refused.value.status == 503
        ticket.release()
        other.release()

    run(scenario())


def test_config_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        AdmissionConfig(max_queued=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        AdmissionConfig(max_wait_s=0)
    with pytest.raises(ValueError, match="retry_poll_s"):
        AdmissionConfig(retry_poll_s=0)
