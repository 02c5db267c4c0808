"""A LayerSplit prefill replica (one process per stage) and a decode worker, on 127.0.0.1.

Greedy outputs equal the single-process oracle for short and chunked prompts longer than
``index_topk`` (streamed chunk by chunk), with prefix hits exact; decode verifies every stage's
every chunk write against its checksum; a killed stage fails only its requests, quickly, and
frees everything; a cancellation storm leaves every stage's and decode's pool full.
(Byte-identical KV against one process: tests/engine/test_stage_engine.py.)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import grpc
import pytest
from logprob_oracle import reference_logprobs
from stage_fixtures import Replica
from worker_fixtures import (
    HAS_MODEL,
    MODEL_DIR,
    Outcome,
    WorkerProcess,
    generate,
    generate_request,
    greedy_oracle,
)

from glmserve.core.generation import SamplingParams
from glmserve.kv.transfer import nixl_unavailable_reason
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc

pytestmark = pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")

KIND = "nixl" if nixl_unavailable_reason() is None else "tcp"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
CHUNK, STREAM_MIN = 128, 100  # chunks shorter than index_topk (128) and prompts of several chunks
STAGE_FLAGS = ("--chunk-tokens", str(CHUNK), "--stream-min-tokens", str(STREAM_MIN))


@pytest.fixture(scope="module")
def oracle():
    return greedy_oracle(MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[Replica, WorkerProcess]]:
    logs = tmp_path_factory.mktemp("layersplit")
    replica = Replica.launch(2, KIND, logs, *STAGE_FLAGS)
    decode = WorkerProcess.launch("decode", KIND, logs / "decode.log", "--checksum")
    try:
        replica.ready(), decode.ready()
        yield replica, decode
    finally:
        codes = [decode.stop(), *replica.stop()]
    assert codes == [0] * len(codes), "a process did not exit cleanly on SIGTERM"


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(10, 8000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


async def _run_all(decode: WorkerProcess, jobs: list[tuple[str, list[int], dict]], prefill: str,
                   limit: int = 4, params: SamplingParams = GREEDY) -> list[Outcome]:
    gate = asyncio.Semaphore(limit)
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = decode_grpc.DecodeStub(channel)

        async def one(rid: str, prompt: list[int], cancel: dict) -> Outcome:
            async with gate:
                return await generate(stub, generate_request(rid, prompt, params, prefill), **cancel)

        return await asyncio.gather(*(one(*job) for job in jobs))


def _wait_idle(replica: Replica, decode: WorkerProcess, free: tuple[list[int], int], timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        state = (replica.free_blocks(), replica.running(), decode.health().free_blocks)
        if state == (free[0], [0] * len(free[0]), free[1]) or time.monotonic() > deadline:
            assert state == (free[0], [0] * len(free[0]), free[1]), f"pools not back: {state}, want {free}"
            return
        time.sleep(0.05)


def test_outputs_equal_one_process_and_prefix_hits_are_exact(cluster, oracle):
    replica, decode = cluster
    free = (replica.free_blocks(), decode.health().free_blocks)
    rng = random.Random(1)
    short, long = _prompts(rng, 2, 5, 90), _prompts(rng, 2, 300, 420)  # below STREAM_MIN; several chunks
    ps = short + long
    outs = asyncio.run(_run_all(decode, [(f"eq-{i}", p, {}) for i, p in enumerate(ps)], replica.address))
    for p, out in zip(ps, outs, strict=True):
        assert out.finish_reason in ("stop", "length") and out.tokens == oracle(p), out.error
        assert out.num_cached_tokens == 0
    # A prompt sharing a prefix with a finished one: every stage holds those blocks' slices.
    shared = long[0][:200] + _prompts(rng, 1, 50, 51)[0]
    again = asyncio.run(_run_all(decode, [("eq-prefix", shared, {})], replica.address))[0]
    assert again.tokens == oracle(shared) and again.num_cached_tokens == 192, again
    # The first token's logprob and top logprobs come from the last stage, through the head.
    with_lp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    lp = asyncio.run(_run_all(decode, [("eq-lp", long[1], {})], replica.address, params=with_lp))[0]
    expected = reference_logprobs(oracle.model, long[1], lp.tokens, 3)
    assert lp.tokens == oracle(long[1])
    assert [v for e in lp.events for v in e.logprobs] == pytest.approx([r.chosen for r in expected], abs=1e-3)
    assert [list(top.token_ids) for e in lp.events for top in e.top_logprobs] == [[t for t, _ in r.top]
                                                                               for r in expected]
    _wait_idle(replica, decode, free)
    head = replica.head.health()
    assert head.ready and head.worker_id == "replica" and head.block_size == 64 and head.cache_root


def test_a_killed_stage_fails_only_its_requests(oracle, tmp_path):
    """kill -9 of stage 1 mid-prefill: the replica's streams end with an error within seconds;
    a one-process prefill worker's requests on the same decode worker finish exactly; decode's
    blocks all come back."""
    replica = Replica.launch(2, KIND, tmp_path, *STAGE_FLAGS, name="doomed")
    healthy = WorkerProcess.launch("prefill", KIND, tmp_path / "prefill.log")
    decode = WorkerProcess.launch("decode", KIND, tmp_path / "decode.log")
    try:
        replica.ready(), healthy.ready(), decode.ready()
        free = decode.health().free_blocks
        rng = random.Random(4)
        ps, others = _prompts(rng, 3, 1700, 1900), _prompts(rng, 2, 200, 300)  # all fit decode's pool at once

        async def scenario() -> tuple[list[Outcome], list[Outcome], float]:
            doomed = asyncio.ensure_future(_run_all(decode, [(f"doomed-{i}", p, {}) for i, p in enumerate(ps)],
                                                    replica.address))
            fine = asyncio.ensure_future(_run_all(decode, [(f"fine-{i}", p, {}) for i, p in enumerate(others)],
                                                  healthy.address))
            deadline = time.monotonic() + 60
            while replica.stage_health(1).running == 0:  # stage 1 has a job: the prefill is under way
                assert time.monotonic() < deadline and not doomed.done(), "no job reached stage 1"
                await asyncio.sleep(0.005)
            replica.kill(1)
            killed = time.monotonic()
            lost = await doomed
            took = time.monotonic() - killed
            return lost, await fine, took

        lost, fine, took = asyncio.run(scenario())
        assert took < 5.0, f"streams took {took:.1f}s to end after the kill"
        assert any(o.finish_reason == "error" for o in lost), [o.error for o in lost]
        for p, out in zip(ps, lost, strict=True):
            assert out.finish_reason == "error" or out.tokens == oracle(p)
        for p, out in zip(others, fine, strict=True):
            assert out.tokens == oracle(p), out.error
        assert decode.wait_free(free).free_blocks == free
        assert not replica.head.health().ready  # until stage 1 is back
        assert replica.head.proc.poll() is None  # the head itself keeps serving
    finally:
        for w in (decode, healthy):
            w.stop()
        replica.stop()


def test_cancellation_storm_leaks_nothing(cluster, oracle):
    replica, decode = cluster
    free = (replica.free_blocks(), decode.health().free_blocks)
    rng = random.Random(2)
    jobs = []
    for i in range(16):
        when = rng.choice(["none", "before", "prefill", "prefill", "decode"])
        prompt = _prompts(rng, 1, 300, 700)[0] if when == "prefill" else _prompts(rng, 1, 5, 300)[0]
        cancel = {"before": {"cancel_after_s": rng.uniform(0.0, 0.01)},
                  "prefill": {"cancel_after_s": rng.uniform(0.02, 0.6)},
                  "decode": {"cancel_after_events": 1}}.get(when, {})
        jobs.append((f"storm-{i}", prompt, cancel))
    outs = asyncio.run(_run_all(decode, jobs, replica.address))
    for (_, prompt, cancel), out in zip(jobs, outs, strict=True):
        if not cancel:
            assert out.finish_reason in ("stop", "length") and out.tokens == oracle(prompt), out.error
        else:
            assert out.tokens == oracle(prompt)[: len(out.tokens)]
    _wait_idle(replica, decode, free)
    aborts = sum(v for k, v in replica.head.metrics().items() if k[0] == "glmserve_aborts_total")
    assert aborts > 0  # the head was told, and told every stage


@pytest.mark.slow
def test_host_tier_holds_whole_blocks_and_each_stage_loads_back_its_slice(oracle, tmp_path):
    """Each stage writes its slice of every prompt block through to the kvstore's host tier (the
    block is stored once both slices landed) and the decode worker its whole blocks; a fresh
    replica (empty device tiers) gets the same cached tokens from the host, each stage loading
    only its slice, and the same greedy tokens; the next turn reuses the block decode wrote."""
    from host_tier_fixtures import HostKVStore

    from glmserve.core.block_hash import reusable_blocks

    kvstore = HostKVStore(tmp_path / "kvstore.log", KIND, 64 << 20, "--check-integrity", start_timeout_s=120.0)
    host = ("--kvstore", kvstore.address, "--check-integrity")
    decode = WorkerProcess.launch("decode", KIND, tmp_path / "decode.log", *host)
    replica = Replica.launch(2, KIND, tmp_path, *STAGE_FLAGS, *host, name="hosted")
    try:
        replica.ready(300), decode.ready(300)
        rng = random.Random(6)
        prompt = [rng.randrange(10, 8000) for _ in range(634)]  # 9 reusable blocks
        reusable = reusable_blocks(len(prompt), 64) * 64
        run = lambda rid, p: asyncio.run(_run_all(decode, [(rid, p, {})], replica.address))[0]  # noqa: E731
        cold = run("cold", prompt)
        assert cold.tokens == oracle(prompt) and cold.num_cached_tokens == 0
        decoded = (len(prompt) + len(cold.tokens) - 1) // 64
        assert kvstore.wait_metric("glmserve_host_tier_blocks", lambda v: v >= decoded) == decoded
        assert replica.stop() == [0, 0]
        replica = Replica.launch(2, KIND, tmp_path, *STAGE_FLAGS, *host, name="hosted").ready(300)
        again = run("from-host", prompt)
        assert (again.tokens, again.num_cached_tokens) == (cold.tokens, reusable)
        turn = prompt + cold.tokens + [rng.randrange(10, 8000) for _ in range(20)]
        nxt = run("turn2", turn)
        assert nxt.tokens == oracle(turn) and nxt.num_cached_tokens == decoded * 64
        assert kvstore.wait_metric("glmserve_host_tier_pinned_blocks", lambda v: v == 0) == 0
    finally:
        codes = [decode.stop(), *replica.stop(), kvstore.stop()]
    assert codes == [0] * len(codes)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["0-7", "0-1,2-3,4-5,6-7"])
def test_one_and_four_stage_replicas_equal_one_process(oracle, tmp_path, split):
    """The same replica with one stage, or four of two layers (stages 2 and 3 start on full layer 2
    and shared layer 4: one carries the top-k), gives the oracle's greedy tokens, streamed."""
    stages = len(split.split(","))
    replica = Replica.launch(stages, KIND, tmp_path, *STAGE_FLAGS, "--layer-split", split, name=f"r{stages}")
    decode = WorkerProcess.launch("decode", KIND, tmp_path / "decode.log", "--checksum")
    try:
        replica.ready(300), decode.ready(300)
        free = (replica.free_blocks(), decode.health().free_blocks)
        rng = random.Random(7)
        ps = _prompts(rng, 1, 5, 90) + _prompts(rng, 2, 300, 420)
        outs = asyncio.run(_run_all(decode, [(f"n{stages}-{i}", p, {}) for i, p in enumerate(ps)], replica.address))
        for p, out in zip(ps, outs, strict=True):
            assert out.finish_reason in ("stop", "length") and out.tokens == oracle(p), out.error
        _wait_idle(replica, decode, free)
    finally:
        codes = [decode.stop(), *replica.stop()]
    assert codes == [0] * len(codes)
