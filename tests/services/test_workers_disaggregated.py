"""Prefill and decode workers as real processes on 127.0.0.1, driven over gRPC like the router does.

Per transfer kind (TCP, and NIXL where it imports): greedy outputs equal the single-process oracle;
random cancellations at every stage leave both block pools full and the other requests exact;
kill -9 of a prefill worker ends the affected streams promptly with an error, frees decode's
blocks, and decode keeps serving with another prefill worker.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import pytest
from logprob_oracle import reference_logprobs
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
from glmserve.core.grammar_spec import GrammarSpec
from glmserve.engine.engine import Engine
from glmserve.kv.transfer import nixl_unavailable_reason
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc
from glmserve.text.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")

_NIXL = nixl_unavailable_reason()
TRANSFERS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(_NIXL is not None, reason=f"nixl: {_NIXL}"))]
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def oracle():
    return greedy_oracle(MAX_TOKENS)


@pytest.fixture(scope="module", params=TRANSFERS)
def workers(request, tmp_path_factory) -> Iterator[tuple[str, WorkerProcess, WorkerProcess]]:
    kind, logs = request.param, tmp_path_factory.mktemp(f"workers-{request.param}")
    prefill = WorkerProcess.launch("prefill", kind, logs / "prefill.log")
    decode = WorkerProcess.launch("decode", kind, logs / "decode.log")  # both load at once
    try:
        prefill.ready(), decode.ready()
        yield kind, prefill, decode
    finally:
        codes = [w.stop() for w in (decode, prefill)]
    assert codes == [0, 0], "a worker did not exit cleanly on SIGTERM"


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(10, 8000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


async def _run_all(decode: WorkerProcess, jobs: list[tuple[str, list[int], dict]], prefill: str,
                   params: SamplingParams = GREEDY, limit: int = 6, local: set[str] = frozenset()) -> list[Outcome]:
    """Run ``(request id, prompt, cancel kwargs)`` jobs, at most ``limit`` at a time; those whose id
    is in ``local`` are prefilled by the decode worker itself."""
    gate = asyncio.Semaphore(limit)
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = decode_grpc.DecodeStub(channel)

        async def one(rid: str, prompt: list[int], cancel: dict) -> Outcome:
            async with gate:
                return await generate(stub, generate_request(rid, prompt, params, prefill, local=rid in local),
                                      **cancel)

        return await asyncio.gather(*(one(*job) for job in jobs))


def _assert_pools_full(prefill: WorkerProcess, decode: WorkerProcess, free: tuple[int, int]) -> None:
    for worker, blocks in zip((prefill, decode), free, strict=True):
        h = worker.wait_free(blocks)
        assert (h.free_blocks, h.running, h.waiting) == (blocks, 0, 0), f"{worker.role} pool not back: {h}"


def test_outputs_equal_single_process(workers, oracle):
    kind, prefill, decode = workers
    free = (prefill.health().free_blocks, decode.health().free_blocks)
    ps = _prompts(random.Random(1), 6, 5, 300)
    outs = asyncio.run(_run_all(decode, [(f"ok-{kind}-{i}", p, {}) for i, p in enumerate(ps)], prefill.address))
    for p, out in zip(ps, outs, strict=True):
        assert out.finish_reason in ("stop", "length") and out.tokens == oracle(p), out.error
    # The same prompt again: its full blocks come from the prefill worker's prefix cache.
    again = asyncio.run(_run_all(decode, [(f"again-{kind}", ps[5], {})], prefill.address))[0]
    assert again.tokens == oracle(ps[5]) and again.num_cached_tokens == len(ps[5]) // 64 * 64 > 0
    # Logprobs and top logprobs come with every token, the first one's from the prefill worker, and
    # equal the model's log_softmax.
    with_lp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    lp = asyncio.run(_run_all(decode, [(f"lp-{kind}", ps[0], {})], prefill.address, with_lp))[0]
    assert lp.tokens == oracle(ps[0])
    values = [v for e in lp.events for v in e.logprobs]
    tops = [[(t, v) for t, v in zip(top.token_ids, top.logprobs, strict=True)] for e in lp.events for top in e.top_logprobs]
    expected = reference_logprobs(oracle.model, ps[0], lp.tokens, 3)
    assert values == pytest.approx([r.chosen for r in expected], abs=1e-3)
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in r.top] for r in expected]
    assert asyncio.run(_bad_requests(decode, prefill.address)) == ["INVALID_ARGUMENT"] * 3
    _assert_pools_full(prefill, decode, free)
    d, p = decode.metrics(), prefill.metrics()
    for name in ("glmserve_worker_time_to_first_token_seconds_count", "glmserve_spec_acceptance_length_count",
                 "glmserve_worker_generation_tokens_total", "glmserve_worker_inter_token_latency_seconds_count"):
        assert d[(name, ())] > 0, name
    for name in ("glmserve_kv_transfer_bytes_total", "glmserve_kv_transfer_seconds_count",
                 "glmserve_worker_prompt_tokens_total"):
        assert p[(name, ())] > 0, name
    assert d[("glmserve_kv_blocks_free", ())] == free[1] and d[("glmserve_kv_blocks_used", ())] == 0


def test_grammar_crosses_prefill_and_decode(workers):
    """A json_schema request through both workers (decode runs MTP "auto") equals the
    same request on one in-process engine without MTP, and validates."""
    kind, prefill, decode = workers
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
    spec = GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Lima?"}])
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=spec)
    out = asyncio.run(_run_all(decode, [(f"grammar-{kind}", prompt, {})], prefill.address, params))[0]
    single = Engine.from_model_dir(MODEL_DIR, mtp="off").generate([prompt], params)[0]
    assert out.finish_reason == "stop" and out.tokens == single.output_ids, out.error
    jsonschema.validate(json.loads(tokenizer.decode(out.tokens[:-1])), schema)


async def _bad_requests(decode: WorkerProcess, prefill: str) -> list[str]:
    """Bad input is refused before any event, with the status code's name."""
    bad = [generate_request("bad-empty", [], GREEDY, prefill),
           generate_request("bad-token", [9_999_999], GREEDY, prefill),
           generate_request("bad-sampling", [5], SamplingParams(max_tokens=1, top_p=0.5), prefill)]
    bad[2].sampling.top_p = 1.5
    codes = []
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stub = decode_grpc.DecodeStub(channel)
        for request in bad:
            try:
                events = [e async for e in stub.Generate(request, timeout=10)]
                codes.append(f"OK {events}")
            except grpc.aio.AioRpcError as e:
                codes.append(e.code().name)
    return codes


def _cancellation_storm(kind: str, prefill: WorkerProcess, decode: WorkerProcess, oracle, n: int, seed: int,
                        local_share: float = 0.0):
    """``local_share``: the part of the requests the decode worker prefills itself."""
    rng = random.Random(seed)
    free = (prefill.health().free_blocks, decode.health().free_blocks)
    jobs = []
    for i in range(n):
        stage = rng.choice(["none", "none", "before", "prefill", "decode"])
        long = stage == "prefill" or rng.random() < 0.2
        prompt = _prompts(rng, 1, 600, 900)[0] if long else _prompts(rng, 1, 5, 300)[0]
        cancel = {"before": {"cancel_after_s": rng.uniform(0.0, 0.01)},
                  "prefill": {"cancel_after_s": rng.uniform(0.02, 0.5)},
                  "decode": {"cancel_after_events": rng.randint(1, 3)}}.get(stage, {})
        jobs.append((f"storm-{kind}-{seed}-{i}", prompt, cancel))
    local = {rid for rid, _, _ in jobs if rng.random() < local_share}
    start = time.monotonic()
    outs = asyncio.run(_run_all(decode, jobs, prefill.address, local=local))
    elapsed = time.monotonic() - start
    for (_, prompt, cancel), out in zip(jobs, outs, strict=True):
        if not cancel:
            assert out.finish_reason in ("stop", "length") and out.tokens == oracle(prompt), out.error
        else:  # whatever it got before the cancel is the start of the unloaded output
            assert out.tokens == oracle(prompt)[: len(out.tokens)]
    _assert_pools_full(prefill, decode, free)
    d, p = decode.metrics(), prefill.metrics()
    aborted = {dict(k[1])["stage"] for k, v in d.items() if k[0] == "glmserve_aborts_total" and v > 0}
    assert {"prefill", "decode"} <= aborted, f"cancellations did not reach every stage: {aborted}"
    assert sum(v for k, v in p.items() if k[0] == "glmserve_aborts_total") > 0  # prefill was told
    assert d.get(("glmserve_kv_transfer_failures_total", (("reason", "stamp"),)), 0) == 0
    return elapsed


def test_random_cancellations(workers, oracle):
    kind, prefill, decode = workers
    _cancellation_storm(kind, prefill, decode, oracle, n=30, seed=2)


def test_local_prefill(workers, oracle):
    """Prompts the decode worker prefills itself (the router's local prefill), beside ones a prefill
    worker computes: every output equals the oracle, its prefix cache serves a repeat, and
    cancellations at every stage of both paths leave both pools full."""
    kind, prefill, decode = workers
    free = (prefill.health().free_blocks, decode.health().free_blocks)
    before = decode.metrics().get(("glmserve_decode_local_prefills_total", ()), 0)
    ps = _prompts(random.Random(5), 6, 5, 300)
    jobs = [(f"local-{kind}-{i}", p, {}) for i, p in enumerate(ps)]
    local = {rid for rid, _, _ in jobs[::2]}
    outs = asyncio.run(_run_all(decode, jobs, prefill.address, local=local))
    for p, out in zip(ps, outs, strict=True):
        assert out.finish_reason in ("stop", "length") and out.tokens == oracle(p), out.error
    again = asyncio.run(_run_all(decode, [(f"local-again-{kind}", ps[0], {})], prefill.address,
                                 local={f"local-again-{kind}"}))[0]
    assert again.tokens == oracle(ps[0]) and again.num_cached_tokens == len(ps[0]) // 64 * 64
    assert decode.metrics()[("glmserve_decode_local_prefills_total", ())] - before == len(local) + 1
    _assert_pools_full(prefill, decode, free)
    _cancellation_storm(kind, prefill, decode, oracle, n=30, seed=6, local_share=0.5)


@pytest.mark.slow
def test_cancellation_storm_300(workers, oracle):
    kind, prefill, decode = workers
    _cancellation_storm(kind, prefill, decode, oracle, n=300, seed=3)


def test_prefill_worker_killed(workers, oracle, tmp_path: Path):
    kind, healthy, decode = workers
    free = decode.health().free_blocks
    doomed = WorkerProcess.launch("prefill", kind, tmp_path / "doomed.log").ready()
    ps = _prompts(random.Random(4), 4, 1200, 1500)

    async def scenario() -> tuple[list[Outcome], float]:
        jobs = [(f"doomed-{kind}-{i}", p, {}) for i, p in enumerate(ps)]
        run = asyncio.ensure_future(_run_all(decode, jobs, doomed.address))
        while decode.health().waiting == 0:  # blocks reserved: decode now waits for the prefill worker
            await asyncio.sleep(0.01)
        doomed.kill()
        killed = time.monotonic()
        outs = await run
        return outs, time.monotonic() - killed

    outs, took = asyncio.run(scenario())
    assert took < 5.0, f"streams took {took:.1f}s to end after the kill"
    failed = [o for o in outs if o.finish_reason == "error"]
    assert failed and all(doomed.address in o.error for o in failed), [o.error for o in outs]
    assert all(o.retryable for o in failed)  # before any token: ABORTED, the router tries again
    for p, out in zip(ps, outs, strict=True):
        assert out.finish_reason == "error" or out.tokens == oracle(p)
    h = decode.wait_free(free)  # freed after the dead writer's grace period
    assert (h.free_blocks, h.ready) == (free, True)
    again = asyncio.run(_run_all(decode, [(f"after-kill-{kind}", ps[0], {})], healthy.address))[0]
    assert again.tokens == oracle(ps[0])
