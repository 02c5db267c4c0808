"""The host KV tier end to end: a kvstore with a host tier and prefill / decode workers attached
to it, all real processes on 127.0.0.1, for each transfer kind (TCP, and NIXL where it imports).

- A second identical request hits the device tier; after the prefill worker's device tier was
  flushed (a restart), a third one gets the same cached tokens from the host tier; greedy outputs
  equal the cold run.
- The next agent turn (prompt + answer + tool result) reuses the block holding generated tokens,
  which only the decode worker computed and wrote through.
- A load-back cancelled mid-way frees what it held on both sides.
- Pools end full (nothing leaked by write-through or load-back); the host tier has nothing pinned.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from host_tier_fixtures import HostKVStore, hit_tokens
from worker_fixtures import HAS_MODEL, MODEL_DIR, Outcome, WorkerProcess, generate, generate_request

from glmserve.core.block_hash import reusable_blocks
from glmserve.core.generation import SamplingParams
from glmserve.kv.transfer import nixl_unavailable_reason
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc

pytestmark = [pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}"), pytest.mark.slow]

_NIXL = nixl_unavailable_reason()
TRANSFERS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(_NIXL is not None, reason=f"nixl: {_NIXL}"))]
BLOCK = 64  # the engine's default block size
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def wait_used_zero(worker: WorkerProcess, timeout_s: float = 15.0) -> float:
    """Poll the worker's used-blocks gauge until it is 0; the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = worker.metrics()[("glmserve_kv_blocks_used", ())]
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


class Cluster:
    def __init__(self, kind: str, logs: Path) -> None:
        self.kind, self.logs = kind, logs
        self.kvstore = HostKVStore(logs / "kvstore.log", kind, 64 << 20, "--check-integrity",
                                   "--fault-load-delay-s", "20")
        self.decode = self._launch("decode")
        self.prefill = self._launch("prefill")
        self.decode.ready(), self.prefill.ready()
        self.restarts = 0

    def _launch(self, role: str, suffix: str = "") -> WorkerProcess:
        return WorkerProcess.launch(role, self.kind, self.logs / f"{role}{suffix}.log",
                                    "--kvstore", self.kvstore.address, "--check-integrity")

    def restart_prefill(self) -> None:
        """A fresh prefill worker: its device tier is empty, the host tier is not."""
        assert self.prefill.stop() == 0
        self.restarts += 1
        self.prefill = self._launch("prefill", f"-{self.restarts}").ready()

    def run(self, rid: str, prompt: list[int], cancel_after_s: float | None = None) -> Outcome:
        async def go() -> Outcome:
            async with grpc.aio.insecure_channel(self.decode.address) as channel:
                request = generate_request(rid, prompt, GREEDY, self.prefill.address)
                return await generate(decode_grpc.DecodeStub(channel), request, cancel_after_s=cancel_after_s)

        out = asyncio.run(go())
        if cancel_after_s is None:
            assert out.finish_reason == "length" and not out.error, out
        return out

    def stop(self) -> list[int]:
        return [self.decode.stop(), self.prefill.stop(), self.kvstore.stop()]


@pytest.fixture(scope="module", params=TRANSFERS)
def cluster(request, tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(request.param, tmp_path_factory.mktemp(f"host-{request.param}"))
    try:
        yield c
    finally:
        assert c.stop() == [0, 0, 0], "a process did not exit cleanly on SIGTERM"


def test_host_hit_after_device_flush_and_next_turn_reuses_decoded_blocks(cluster: Cluster) -> None:
    rng = random.Random(6)
    prompt = [rng.randrange(10, 8000) for _ in range(634)]  # 9 reusable blocks; block 10 ends in decode
    reusable = reusable_blocks(len(prompt), BLOCK) * BLOCK
    cold = cluster.run("cold", prompt)
    assert cold.num_cached_tokens == 0 and len(cold.tokens) == MAX_TOKENS

    warm = cluster.run("warm", prompt)
    assert (warm.tokens, warm.num_cached_tokens) == (cold.tokens, reusable)
    assert hit_tokens(cluster.prefill.metrics(), "device") == reusable

    # Write-through of both workers' blocks is asynchronous: wait until the host has them all.
    decoded_blocks = (len(prompt) + MAX_TOKENS - 1) // BLOCK
    assert cluster.kvstore.wait_metric("glmserve_host_tier_blocks", lambda v: v >= decoded_blocks) == decoded_blocks
    cluster.restart_prefill()

    # A load-back cancelled mid-way (the kvstore holds loads of "fault-delay-*" requests until
    # cancelled) frees everything it held, on both sides; the next load is whole.
    cancelled = cluster.run("fault-delay-cancel", prompt, cancel_after_s=2.0)
    assert cancelled.cancelled and cancelled.tokens == []
    assert wait_used_zero(cluster.prefill) == 0 and wait_used_zero(cluster.decode) == 0
    assert cluster.kvstore.wait_metric("glmserve_host_tier_pinned_blocks", lambda v: v == 0) == 0
    m = cluster.prefill.metrics()
    assert sum(v for (name, labels), v in m.items()
               if name == "glmserve_aborts_total" and ("stage", "load") in labels) == 1
    assert m[("glmserve_host_tier_loadbacks_total", ())] == 0

    from_host = cluster.run("host", prompt)
    assert (from_host.tokens, from_host.num_cached_tokens) == (cold.tokens, reusable)
    m = cluster.prefill.metrics()
    assert (hit_tokens(m, "host"), hit_tokens(m, "device")) == (reusable, 0)
    assert m[("glmserve_host_tier_loadbacks_total", ())] == 1

    # Next agent turn: prompt + answer + tool result. Block 10 holds the prompt's tail and generated
    # tokens: only the decode worker computed it, and wrote it through to the host.
    turn = prompt + cold.tokens + [rng.randrange(10, 8000) for _ in range(20)]
    before_host = hit_tokens(m, "host")
    nxt = cluster.run("turn2", turn)
    assert nxt.num_cached_tokens == reusable_blocks(len(turn), BLOCK) * BLOCK == decoded_blocks * BLOCK
    m = cluster.prefill.metrics()
    assert hit_tokens(m, "host") - before_host == BLOCK  # the decoded block; the rest from device

    # Nothing leaked: both pools are whole again, the host tier holds no pins.
    for worker in (cluster.prefill, cluster.decode):
        assert wait_used_zero(worker) == 0, worker.role
    assert cluster.kvstore.wait_metric("glmserve_host_tier_pinned_blocks", lambda v: v == 0) == 0


def test_workers_attach_again_after_a_kvstore_restart(cluster: Cluster) -> None:
    """kill -9 of the kvstore, then a new one on the same address (what the launcher does): the
    workers attach to its empty host tier and republish their blocks; hits from the host resume."""
    rng = random.Random(8)
    prompt = [rng.randrange(10, 8000) for _ in range(400)]
    reusable = reusable_blocks(len(prompt), BLOCK) * BLOCK
    # Blocks to republish, whatever ran before: their write-through done before the kill
    earlier = cluster.run("before-restart", [rng.randrange(10, 8000) for _ in range(200)])
    written = (200 + len(earlier.tokens)) // BLOCK
    assert cluster.kvstore.wait_metric("glmserve_host_tier_blocks", lambda v: v >= written) >= written
    cluster.kvstore.restart()
    # The index is rebuilt by the workers' publishers (they see the new epoch): the prefill
    # worker's earlier prompts are found again without any new request.
    deadline = time.monotonic() + 10
    while not cluster.kvstore.indexed_blocks("device"):
        assert time.monotonic() < deadline, "the workers did not republish their blocks"
        time.sleep(0.1)
    # Write-through reaches the new host tier only once the workers attached to it again: the first
    # attach sizes the tier; each worker's link checks its kvstore every second (HostTierLink._watch)
    # and skips writes while detached, so give both two checks.
    assert cluster.kvstore.wait_metric("glmserve_host_tier_capacity_blocks", lambda v: v > 0) > 0
    time.sleep(2.5)
    cold = cluster.run("after-restart-cold", prompt)
    blocks = (len(prompt) + MAX_TOKENS - 1) // BLOCK
    assert cluster.kvstore.wait_metric("glmserve_host_tier_blocks", lambda v: v >= blocks) >= blocks
    cluster.restart_prefill()
    again = cluster.run("after-restart-host", prompt)
    assert (again.tokens, again.num_cached_tokens) == (cold.tokens, reusable)
    assert hit_tokens(cluster.prefill.metrics(), "host") == reusable


def test_memory_pressure_demotes_and_never_drops_blocks_in_use(tmp_path: Path) -> None:
    """A prefill worker with room for about three prompts, write-through off, and a host tier that
    is itself too small: evicted device blocks are demoted (copied to the host before reuse), host
    eviction skips pinned blocks, integrity checks run after every step and host operation, and
    every output still equals the first round's (TCP; the transfer kinds are covered above)."""
    # 24 device and 20 host blocks against ~40 distinct prompt blocks: the device demotes from the
    # first round on, and the host must evict (already in the second round).
    kvstore = HostKVStore(tmp_path / "kvstore.log", "tcp", 20 * 372_736, "--check-integrity")
    flags = ("--kvstore", kvstore.address, "--check-integrity", "--host-write-through", "off")
    prefill = WorkerProcess.launch("prefill", "tcp", tmp_path / "prefill.log", *flags, kv_cache_bytes=24 * 372_736)
    decode = WorkerProcess.launch("decode", "tcp", tmp_path / "decode.log", *flags)
    try:
        prefill.ready(), decode.ready()
        rng = random.Random(11)
        prompts = [[rng.randrange(10, 8000) for _ in range(rng.randrange(380, 460))] for _ in range(6)]

        async def round_(tag: str, batch: list[list[int]], limit: int) -> list[Outcome]:
            gate = asyncio.Semaphore(limit)
            async with grpc.aio.insecure_channel(decode.address) as channel:
                stub = decode_grpc.DecodeStub(channel)

                async def one(i: int, prompt: list[int]) -> Outcome:
                    async with gate:
                        return await generate(stub, generate_request(f"{tag}-{i}", prompt, GREEDY, prefill.address))

                return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))

        first = asyncio.run(round_("first", prompts, 1))
        # Newest first, one at a time: device hits, then blocks only the host still holds (load-back).
        # Concurrently, a load may lose its blocks to host eviction between lookup and load.
        second = asyncio.run(round_("second", prompts[::-1], 1))[::-1]
        third = asyncio.run(round_("third", prompts, 3))  # three at a time, under pressure
        for a, b, c in zip(first, second, third, strict=True):
            assert a.finish_reason == b.finish_reason == c.finish_reason == "length"
            assert not a.error and not b.error and not c.error
            assert a.tokens == b.tokens == c.tokens
        m = prefill.metrics()
        assert m[("glmserve_host_tier_demotions_total", ())] > 0
        assert m[("glmserve_host_tier_writes_total", (("kind", "write_through"),))] == 0
        assert hit_tokens(m, "host") > 0 and m[("glmserve_host_tier_loadbacks_total", ())] > 0
        assert sum(o.num_cached_tokens for o in second + third) == hit_tokens(m, "host") + hit_tokens(m, "device")
        assert kvstore.metrics()["glmserve_host_tier_evictions_total"] > 0
        for worker in (prefill, decode):
            assert wait_used_zero(worker) == 0, worker.role
        assert kvstore.wait_metric("glmserve_host_tier_pinned_blocks", lambda v: v == 0) == 0
    finally:
        codes = [decode.stop(), prefill.stop(), kvstore.stop()]
    assert codes == [0, 0, 0]
    for log in ("kvstore.log", "prefill.log", "decode.log"):
        assert "Traceback" not in (tmp_path / log).read_text(), log
