"""Prefix cache and cache-aware routing end to end: kvstore (index in a real Redis), two prefill
workers and a decode worker publishing block events, the router as a process, the `openai` client.

Covers: cached_tokens of a repeat (all full blocks but the last token) and its routing to the worker
holding the prefix; a changed token reuses exactly the blocks before it; tenant salts; a 10-turn
agent session staying on one worker with a hit every turn; another model revision never matching;
the index surviving a router restart; Redis stopped -> routing from the local view, said in /ready
and /metrics. Slow: five model processes on 127.0.0.1. Tests run in file order on one stack.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from openai import OpenAI
from redis_fixtures import RedisServer, requires_redis_server
from router_process import RouterProcess
from test_kvstore_service import KVStoreProcess
from worker_fixtures import HAS_MODEL, MODEL_DIR, WorkerProcess, generate, generate_request

from glmserve.core.block_hash import block_hashes
from glmserve.core.generation import SamplingParams
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc

pytestmark = [pytest.mark.slow, requires_redis_server,
              pytest.mark.skipif(not HAS_MODEL, reason="bundled model weights not present")]

BS = 64  # the engine's default block size
MODEL = MODEL_DIR.name


@dataclass
class Stack:
    redis: RedisServer
    kvstore: KVStoreProcess
    prefill: list[WorkerProcess]
    decode: WorkerProcess
    other_revision: WorkerProcess  # a prefill worker of another model revision, not in the router
    router: RouterProcess
    tmp: Path

    @property
    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.router.url}/v1", api_key="none", max_retries=0)

    def restart_router(self) -> None:
        self.router.stop()
        self.router = RouterProcess.launch(self.tmp / "router.log", [w.address for w in self.prefill],
                                           [self.decode.address], f"127.0.0.1:{self.kvstore.port}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("prefix-e2e")
    redis = RedisServer(tmp / "redis").start()
    kvstore = KVStoreProcess(tmp / "kvstore.log", redis.url)
    kv = ["--kvstore", f"127.0.0.1:{kvstore.port}"]
    workers = [WorkerProcess.launch("prefill", "tcp", tmp / f"p{i}.log", *kv) for i in range(2)]
    workers.append(WorkerProcess.launch("prefill", "tcp", tmp / "prev.log", *kv, "--revision", "rev-B"))
    decode = WorkerProcess.launch("decode", "tcp", tmp / "d0.log", *kv)
    started = [*workers, decode]
    stack = None
    try:
        for w in started:
            w.ready()
        router = RouterProcess.launch(tmp / "router.log", [w.address for w in workers[:2]], [decode.address],
                                      f"127.0.0.1:{kvstore.port}")
        stack = Stack(redis, kvstore, workers[:2], decode, workers[2], router, tmp)
        yield stack
    finally:
        if stack is not None:
            stack.router.stop()  # the latest one: a test restarts it
        for w in started:
            w.stop()
        kvstore.stop()
        redis.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 8000) for _ in range(n)]


def cached(client: OpenAI, ids: list[int], **extra: object) -> int:
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, **extra)
    return r.usage.prompt_tokens_details.cached_tokens


def holders(stack: Stack, worker: WorkerProcess, ids: list[int]) -> dict[str, int]:
    """worker id -> device blocks of ``ids`` the kvstore index says it holds (under ``worker``'s root)."""
    h = worker.health()
    deadline = time.monotonic() + 5
    while True:  # events are published every 50 ms, a batch may hold only part of a prompt
        found = {w: m.device_blocks for w, m in stack.kvstore.client.lookup(
            block_hashes(h.cache_root, ids, h.block_size)).items() if w.startswith("prefill")}
        if (found and max(found.values()) == len(ids) // h.block_size) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def decisions(router: RouterProcess) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (name, labels), v in router.metrics().items()
            if name == "glmserve_router_routing_decisions_total"}


def test_a_repeat_is_cached_up_to_the_last_token_and_routed_to_the_holder(stack: Stack) -> None:
    ids = prompt(1, 300)  # 4 full blocks; the last token is always computed
    assert cached(stack.client, ids) == 0
    held = holders(stack, stack.prefill[0], ids)
    assert list(held.values()) == [4]  # exactly one prefill worker computed it
    before, m0 = decisions(stack.router), stack.router.metrics()
    for _ in range(2):  # the other worker would report 0: a hit proves the route
        assert cached(stack.client, ids) == 256
    assert decisions(stack.router)["cache_hit"] - before["cache_hit"] == 2
    m1 = stack.router.metrics()
    for name, labels, delta in [("glmserve_prefix_cache_hit_tokens_total", (("tier", "device"),), 512),
                                ("glmserve_prefix_cache_hit_tokens_total", (("tier", "host"),), 0),
                                ("glmserve_prefix_cache_prompt_tokens_total", (), 600),
                                ("glmserve_prefix_cache_lookups_total", (("result", "hit"), ("source", "kvstore")), 2)]:
        assert m1[(name, labels)] - m0.get((name, labels), 0) == delta, name
    assert m1[("glmserve_router_kv_index_up", ())] == 1 and 0 < m1[("glmserve_prefix_cache_hit_ratio", ())] < 1
    exact = prompt(2, 4 * BS)  # an exact multiple: the last block is recomputed
    cached(stack.client, exact)
    assert cached(stack.client, exact) == 3 * BS


def test_a_changed_token_reuses_exactly_the_blocks_before_it(stack: Stack) -> None:
    ids = prompt(3, 300)
    cached(stack.client, ids)
    changed = list(ids)
    changed[150] = 7999 if ids[150] != 7999 else 7998  # in block 2
    assert cached(stack.client, changed) == 2 * BS
    assert cached(stack.client, ids) == 4 * BS


def test_tenants_with_different_salts_never_share(stack: Stack) -> None:
    ids = prompt(4, 300)
    assert cached(stack.client, ids, extra_headers={"x-cache-salt": "tenant-a"}) == 0
    assert cached(stack.client, ids, extra_headers={"x-cache-salt": "tenant-b"}) == 0
    assert cached(stack.client, ids) == 0  # no salt: the shared cache, also separate
    assert cached(stack.client, ids, extra_headers={"x-cache-salt": "tenant-a"}) == 256
    assert cached(stack.client, ids, extra_headers={"x-cache-salt": "tenant-b"}) == 256


def test_an_agent_session_hits_every_turn_and_stays_on_one_worker(stack: Stack) -> None:
    rng = random.Random(5)
    system = "You are a coding agent. Tools: read_file, run_tests. " + " ".join(
        f"rule{rng.randrange(10**6)}" for _ in range(60))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test."}]
    before = decisions(stack.router)
    hits = []
    for turn in range(10):
        r = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 user="agent-session-1")
        hits.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})
        messages.append({"role": "user", "content": f"tool result {turn}: " + " ".join(
            f"line{rng.randrange(10**6)}" for _ in range(12))})
    assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits
    assert hits[1:] == sorted(hits[1:])  # the history only grows
    after = decisions(stack.router)
    assert after["session"] - before["session"] == 9  # turns 2..10 went to the session's worker


def test_another_model_revision_never_shares_blocks(stack: Stack) -> None:
    ids = prompt(6, 300)
    cached(stack.client, ids)  # revision A (the router's workers) now holds it
    a, b = stack.prefill[0].health(), stack.other_revision.health()
    assert a.cache_root != b.cache_root and a.block_size == b.block_size

    async def via_b() -> int:
        async with grpc.aio.insecure_channel(stack.decode.address) as channel:
            rid = f"rev-b-{time.monotonic_ns()}"
            out = await generate(decode_grpc.DecodeStub(channel), generate_request(
                rid, ids, SamplingParams(max_tokens=2), stack.other_revision.address))
            assert out.finish_reason in ("stop", "length"), out.error
            return out.num_cached_tokens

    assert asyncio.run(via_b()) == 0  # worker B never reuses A's KV for the same tokens
    assert asyncio.run(via_b()) == 256  # its own, yes
    in_a = holders(stack, stack.prefill[0], ids)
    in_b = holders(stack, stack.other_revision, ids)
    assert in_a and in_b and not set(in_a) & set(in_b)  # the index never reports one for the other


def test_the_index_survives_a_router_restart(stack: Stack) -> None:
    ids = prompt(7, 300)
    cached(stack.client, ids)
    stack.restart_router()  # a fresh router: empty local view, no sessions
    assert cached(stack.client, ids) == 256
    m = stack.router.metrics()
    assert m[("glmserve_prefix_cache_lookups_total", (("result", "hit"), ("source", "kvstore")))] == 1
    assert decisions(stack.router)["cache_hit"] == 1


def test_with_redis_stopped_the_router_routes_from_its_local_view(stack: Stack) -> None:
    stack.redis.stop()
    deadline = time.monotonic() + 10
    while stack.router.ready().json().get("prefix_index") != "local":
        assert time.monotonic() < deadline, stack.router.ready().json()
        time.sleep(0.1)
    assert stack.router.ready().status_code == 200  # still serving
    ids = prompt(8, 300)
    assert cached(stack.client, ids) == 0
    for _ in range(2):  # the local view knows where it went
        assert cached(stack.client, ids) == 256
    m = stack.router.metrics()
    assert m[("glmserve_router_kv_index_up", ())] == 0
    assert m[("glmserve_prefix_cache_lookups_total", (("result", "hit"), ("source", "local")))] == 2
