"""PrefixRouter (the router's adapter) against a real kvstore gRPC server in this process: hashes
under each worker's reported root, lookups, queued tokens, the local view while the kvstore is gone,
and the metrics it keeps. Fast: no model, no worker processes."""

from __future__ import annotations

import asyncio

from kvstore_fixtures import kvstore
from redis_fixtures import free_port

from glmserve.core.block_hash import CacheKeyRoot, block_hashes
from glmserve.kv.block_index import Tier
from glmserve.services.router.backend import RequestHints
from glmserve.services.router.prefill_routing import RoutingConfig
from glmserve.services.router.prefix_router import PrefixRouter
from glmserve.services.router.worker_pool import HealthReport, WorkerPool

BS = 16
ROOT_A = CacheKeyRoot("rev-a", "tok", "bfloat16", BS, 1).root_hash()
ROOT_B = CacheKeyRoot("rev-b", "tok", "bfloat16", BS, 1).root_hash()
PROMPT = list(range(100, 200))  # 6 full blocks, all reusable (floor(99 / 16) = 6)


class FirstEvent:  # the two fields PrefixRouter.release reads of decode's first event
    finish_reason = ""

    def __init__(self, num_cached_tokens: int) -> None:
        self.num_cached_tokens = num_cached_tokens


def pool(roots: dict[str, bytes]) -> WorkerPool:
    p = WorkerPool("prefill", [f"127.0.0.1:{6000 + i}" for i in range(len(roots))])
    for address, (worker_id, root) in zip(p.addresses, roots.items(), strict=True):
        p.report(address, HealthReport(True, worker_id, free_blocks=100, cache_root=root, block_size=BS),
                 p.epoch(address))
    return p


def metric(router: PrefixRouter, name: str, **labels: str) -> float:
    value = router.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def test_routes_to_the_holder_under_its_own_root_then_falls_back_to_the_local_view() -> None:
    port = free_port()

    async def scenario() -> None:
        with kvstore(port) as client:
            router = PrefixRouter(pool({"p-a": ROOT_A, "p-b": ROOT_B}), kvstore_up=lambda: None)
            router.connect(f"127.0.0.1:{port}")
            # p-b caches the prompt's tokens, but under revision B's root; p-a under its own, 3 blocks.
            client.publish_stored("p-b", Tier.DEVICE, block_hashes(ROOT_B, PROMPT, BS))
            client.publish_stored("p-a", Tier.DEVICE, block_hashes(ROOT_A, PROMPT, BS)[:3])
            routed = await router.route(PROMPT, RequestHints())
            assert (routed.worker_id, routed.decision.reason) == ("p-b", "cache_hit")
            assert routed.decision.device_hit_tokens == 96
            salted = await router.route(PROMPT, RequestHints(cache_salt="tenant"))
            assert salted.decision.device_hit_tokens == 0 and salted.decision.reason == "load"
            # queued work counts until the prefill ends
            router.acquire(routed)
            assert router._queued_tokens[routed.address] == 4
            router.release(routed, FirstEvent(96))
            assert router._queued_tokens[routed.address] == 0
            assert metric(router, "glmserve_prefix_cache_hit_tokens_total", tier="device") == 96
            assert metric(router, "glmserve_prefix_cache_lookups_total", source="kvstore", result="hit") == 1
            assert router.index_source() == "kvstore"
            await router.close()
            router.connect(f"127.0.0.1:{port}")
        # kvstore gone: the lookup fails once, then the local view (which saw the prefill on p-b)
        again = await router.route(PROMPT, RequestHints())
        assert (again.worker_id, again.decision.device_hit_tokens) == ("p-b", 96)
        assert router.index_source() == "local"
        assert metric(router, "glmserve_prefix_cache_lookups_total", source="local", result="hit") == 1
        fresh = await router.route(list(range(300, 400)), RequestHints())
        assert fresh.decision.reason == "fallback"  # nothing known anywhere, no index to ask
        router.refresh_index_gauge()
        assert metric(router, "glmserve_router_kv_index_up") == 0
        await router.close()

    asyncio.run(scenario())


def test_without_a_kvstore_the_local_view_routes_repeats() -> None:
    async def scenario() -> None:
        router = PrefixRouter(pool({"p-a": ROOT_A, "p-b": ROOT_A}))
        first = await router.route(PROMPT, RequestHints(session_id="s"))
        router.acquire(first)
        router.release(first, FirstEvent(0))
        for _ in range(3):
            d = (await router.route(PROMPT, RequestHints())).decision
            assert (d.address, d.reason, d.device_hit_tokens) == (first.address, "cache_hit", 96)
        failed = await router.route(list(range(500, 600)), RequestHints())
        router.acquire(failed)
        router.release(failed, None)  # no first event: nothing was cached
        assert router.local_view.num_blocks() == 6
        assert router.index_source() == "local"

    asyncio.run(scenario())


def test_least_queued_tokens_is_the_soonest_start_of_a_healthy_worker() -> None:
    """The decode worker's local-prefill rule compares against this, not the chosen worker's queue
    (a cache hit may have chosen the longer one)."""
    async def scenario() -> None:
        workers = pool({"p-a": ROOT_A, "p-b": ROOT_A})
        router = PrefixRouter(workers)
        assert router.least_queued_tokens() == 0
        first = await router.route(PROMPT, RequestHints())
        router.acquire(first)
        second = await router.route(list(range(300, 340)), RequestHints())
        assert second.address != first.address  # the other worker had nothing queued
        router.acquire(second)
        assert router.least_queued_tokens() == 40
        workers.report(second.address, HealthReport(False, "", free_blocks=0), workers.epoch(second.address))
        assert router.least_queued_tokens() == 100  # an unhealthy worker starts nothing
        router.release(first, FirstEvent(0))
        assert router.least_queued_tokens() == 0
        await router.close()

    asyncio.run(scenario())


def test_the_decode_workers_own_blocks_are_looked_up_under_cache_aware_routing_only() -> None:
    """`LocalPrefill` counts what the decode worker already holds (it decoded the earlier turns);
    a baseline policy is told of no hits, its own included."""
    port = free_port()

    async def scenario() -> None:
        with kvstore(port) as client:
            decode = WorkerPool("decode", ["127.0.0.1:7000"])
            decode.report("127.0.0.1:7000", HealthReport(True, "d-0", free_blocks=100, cache_root=ROOT_A,
                                                         block_size=BS), decode.epoch("127.0.0.1:7000"))
            client.publish_stored("d-0", Tier.DEVICE, block_hashes(ROOT_A, PROMPT, BS)[:4])
            for policy, expected in (("cache_aware", 64), ("least_loaded", 0)):
                router = PrefixRouter(pool({"p-a": ROOT_A}), RoutingConfig(policy=policy), kvstore_up=lambda: True)
                router.connect(f"127.0.0.1:{port}")
                routed = await router.route(PROMPT, RequestHints(), decode.view("127.0.0.1:7000"))
                assert (routed.local_hit_tokens, routed.local_compute_tokens) == (expected, 100 - expected)
                assert routed.decision.device_hit_tokens == 0  # the prefill worker holds none of it
                assert (await router.route(PROMPT, RequestHints())).local_hit_tokens == 0  # no decode worker named
                await router.close()

    asyncio.run(scenario())
