"""The workers' transport-free logic, in this process: stamps, generations, the abort answers.

The decode worker runs on a small random model with a real TCP receiver; its prefill worker is a
fake `PrefillPort` that does what a prefill worker does (its own engine, a real TCP writer) and
can misbehave on purpose: send a stale generation first, stamp the wrong generation, corrupt the
bytes, or never answer.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.kv.transfer import TransferStamp
from glmserve.kv.transfer.tcp_backend import TcpTransferBackend
from glmserve.model.greedy import greedy_generate
from glmserve.services.decode.arrivals import TransferArrivals
from glmserve.services.decode.prefill_client import AbortAnswer, PrefillAnswer, PrefillCall
from glmserve.services.decode.worker import DecodeFull, DecodeSettings, DecodeWorker
from glmserve.services.prefill.history import PrefillHistory
from glmserve.services.prefill.job import PrefillAborted, PrefillJob
from glmserve.services.prefill.worker import PrefillWorker
from tests.engine.engine_fixtures import prompts, random_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _engine(seed: int = 1) -> Engine:
    config = EngineConfig(block_size=16, kv_cache_bytes=2 * 2**20, max_step_tokens=64, mtp=2)
    return Engine(random_model(seed), config)


class FakePrefill:
    """A `PrefillPort` that prefills on its own engine and writes with a real TCP writer."""

    def __init__(self, stale_first: bool = False, generation_offset: int = 0, corrupt: bool = False,
                 hang: bool = False, abort_answer: AbortAnswer = AbortAnswer.DRAINED) -> None:
        self.engine = _engine()
        self.backend = TcpTransferBackend()
        self.backend.register(self.engine.cache.buffer)
        self.stale_first, self.generation_offset, self.corrupt = stale_first, generation_offset, corrupt
        self.hang, self.abort_answer = hang, abort_answer
        self.aborts: list[tuple[str, int, str]] = []

    async def prefill(self, target: str, call: PrefillCall, timeout_s: float) -> PrefillAnswer:
        if self.hang:
            await asyncio.sleep(3600)
        e, key = self.engine, f"{call.request_id}@{call.generation}"
        e.add_request(key, list(call.prompt_ids), dataclasses.replace(call.params, max_tokens=1), hold_blocks=True)
        while e.has_unfinished():
            e.step()
        held = e.held_prefill(key)
        peer = self.backend.connect(call.decode_target)
        src, dst = held.block_ids[: len(call.dest_block_ids)], list(call.dest_block_ids)
        if self.stale_first:  # an older generation's write completes first: it must be ignored
            await self._write(peer, TransferStamp(call.request_id, call.generation - 1), src, dst)
        stamp = TransferStamp(call.request_id, call.generation + self.generation_offset)
        if call.checksum:
            stamp = stamp.with_checksum(e.cache.buffer, src)
        if self.corrupt:
            e.cache.buffer[src[0], :8] += 1.0  # the bytes sent are not the bytes stamped
        await self._write(peer, stamp, src, dst)
        e.release(key)
        return PrefillAnswer(held.output, stamp.encode())

    async def _write(self, peer: str, stamp: TransferStamp, src: list[int], dst: list[int]) -> None:
        handle = self.backend.write(peer, stamp, src, dst)
        assert await asyncio.to_thread(handle.wait, 10) == "done", handle.error

    async def abort(self, target: str, request_id: str, generation: int, reason: str,
                    timeout_s: float) -> AbortAnswer:
        self.aborts.append((request_id, generation, reason))
        return self.abort_answer

    async def close(self) -> None:
        self.backend.close()


async def _run(prefill: FakePrefill, ps: list[list[int]], generation: int = 3, **settings):
    """Generate ``ps`` concurrently; (outputs, final events, decode blocks used afterwards)."""
    worker = DecodeWorker(_engine, TcpTransferBackend(), prefill,
                          DecodeSettings(**{"arrival_timeout_s": 0.5, **settings}))
    await worker.start()
    try:
        async def one(i: int, p: list[int]):
            tokens, last = [], None
            async for event in await worker.generate(f"r{i}", generation, p, GREEDY, "fake:1"):
                tokens += event.token_ids
                last = event
            return tokens, last

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))
        used = await worker.engine.submit(lambda e: (e.pool.check_integrity(), e.pool.num_used)[1])
        return [r[0] for r in results], [r[1] for r in results], used
    finally:
        await worker.close()


@pytest.fixture(scope="module")
def oracle():
    model = random_model(1)
    return lambda p: greedy_generate(model, p, GREEDY.max_tokens, stop_ids=model.config.eos_token_ids,
                                     block_size=16)


def test_stale_generation_is_ignored_and_outputs_match(oracle):
    ps = prompts(3, seed=5, min_len=10, max_len=60)
    outputs, finals, used = asyncio.run(_run(FakePrefill(stale_first=True), ps))
    assert outputs == [oracle(p) for p in ps]
    assert all(f.finish_reason in ("stop", "length") for f in finals)
    assert used == 0


def test_stamp_of_another_generation_is_rejected():
    outputs, finals, used = asyncio.run(_run(FakePrefill(generation_offset=1), prompts(1, seed=6)))
    assert finals[0].finish_reason == "error" and "completion did not arrive" in finals[0].error
    assert outputs == [[]] and used == 0


def test_checksum_mismatch_is_rejected(oracle):
    ps = prompts(1, seed=7, min_len=10, max_len=40)
    outputs, finals, used = asyncio.run(_run(FakePrefill(corrupt=True), ps, checksum=True))
    assert finals[0].finish_reason == "error" and "checksum" in finals[0].error
    assert used == 0
    outputs, finals, used = asyncio.run(_run(FakePrefill(), ps, checksum=True))  # intact bytes pass
    assert outputs == [oracle(ps[0])] and used == 0


def test_out_of_blocks_is_refused_before_the_stream():
    async def scenario():
        prefill = FakePrefill()
        worker = DecodeWorker(_engine, TcpTransferBackend(), prefill)
        await worker.start()
        try:
            with pytest.raises(DecodeFull, match="out of KV blocks"):
                await worker.generate("big", 1, [5] * 4000, GREEDY, "fake:1")
            with pytest.raises(ValueError, match="prompt_ids"):
                await worker.generate("bad", 1, [10**6], GREEDY, "fake:1")
            assert await worker.engine.submit(lambda e: e.pool.num_used) == 0 and not prefill.aborts
            assert worker.health().ready
        finally:
            await worker.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("answer, freed_within", [(AbortAnswer.DRAINED, 0.5), (AbortAnswer.PEER_GONE, 1.5),
                                                  (AbortAnswer.NOT_DRAINED, 3.5)])
def test_prefill_timeout_aborts_prefill_and_frees_per_answer(answer, freed_within):
    """No answer within the deadline: decode tells prefill to Abort; blocks are freed now (drained),
    after the grace (peer gone) or after the agreed timeout (not drained) and not before."""

    async def scenario():
        prefill = FakePrefill(hang=True, abort_answer=answer)
        settings = DecodeSettings(prefill_timeout_s=2.0, dead_peer_grace_s=1.0)
        worker = DecodeWorker(_engine, TcpTransferBackend(), prefill, settings)
        await worker.start()
        try:
            loop = asyncio.get_running_loop()
            events = [e async for e in await worker.generate("r", 1, prompts(1, seed=8)[0], GREEDY, "fake:1")]
            ended = loop.time()
            assert events[-1].finish_reason == "error" and prefill.aborts == [("r", 1, events[-1].error)]
            used = lambda: worker.engine.submit(lambda e: e.pool.num_used)  # noqa: E731
            if answer is not AbortAnswer.DRAINED:
                await asyncio.sleep(0.2)
                assert await used() > 0  # not freed while the writer may still write
            while await used() > 0:
                assert loop.time() - ended < freed_within
                await asyncio.sleep(0.05)
        finally:
            await worker.close()

    asyncio.run(scenario())


def test_prefill_worker_abort_and_late_prefill():
    """In compute, Abort frees the blocks and answers drained; an Abort that overtakes its Prefill
    leaves a tombstone that refuses the late Prefill; a normal job lands its bytes, stamped."""

    async def scenario():
        receiver_engine = _engine()  # a decode-shaped buffer to write into
        receiver = TcpTransferBackend()
        receiver.register(receiver_engine.cache.buffer)
        worker = PrefillWorker(_engine, TcpTransferBackend())
        await worker.start()
        try:
            def job(rid: str, prompt: list[int]) -> PrefillJob:
                dest = list(range(10, 10 + -(-len(prompt) // 16)))
                return PrefillJob(rid, 1, prompt, GREEDY, receiver.target_info(), dest, "tcp")

            long_prompt = prompts(1, seed=9, min_len=400, max_len=401)[0]  # several engine steps
            running = asyncio.create_task(worker.prefill(job("a", long_prompt)))
            while worker.engine.snapshot.running + worker.engine.snapshot.waiting == 0:
                await asyncio.sleep(0.001)  # until the engine computes it
            outcome = await worker.abort("a", 1, "test")
            assert (outcome.found, outcome.drained) == (True, True)
            with pytest.raises(PrefillAborted):
                await running
            assert (await worker.abort("b", 1, "early")).drained  # b's Prefill is still on its way
            with pytest.raises(PrefillAborted, match="already aborted"):
                await worker.prefill(job("b", long_prompt))
            result = await worker.prefill(job("c", long_prompt[:40]))
            assert receiver.completions() == [result.stamp] and result.stamp == TransferStamp("c", 1)
            src = await worker.engine.submit(lambda e: e.pool.num_used)
            assert src == 0 and len(result.output.mtp_hidden) == 4 * receiver_engine.model.config.hidden_size
        finally:
            await worker.close()
            receiver.close()

    asyncio.run(scenario())


def test_arrivals_accept_only_the_expected_pair():
    async def scenario():
        stale: list[str] = []
        arrivals = TransferArrivals(lambda stamp, why: stale.append(why))
        future = arrivals.expect("a", 2)
        assert not arrivals.deliver(TransferStamp("a", 1))  # older generation
        assert not arrivals.deliver(TransferStamp("a", 3))  # ahead of the current one
        assert not arrivals.deliver(TransferStamp("b", 2))  # nobody waits for b
        assert arrivals.deliver(TransferStamp("a", 2)) and future.result() == (TransferStamp("a", 2),)
        assert not arrivals.deliver(TransferStamp("a", 2))  # a duplicate
        gone = arrivals.expect("c", 1)
        arrivals.forget("c", 1)
        assert gone.cancelled() and not arrivals.deliver(TransferStamp("c", 1))
        old = arrivals.expect("d", 1)
        arrivals.expect("d", 2)  # a newer generation replaces the old one
        assert old.cancelled() and not arrivals.deliver(TransferStamp("d", 1))
        with pytest.raises(ValueError, match="generation"):
            arrivals.expect("d", 1)
        assert len(stale) == 6 and arrivals.waiting == 1

    asyncio.run(scenario())


def test_prefill_history_moves_forward():
    h = PrefillHistory(ttl_s=60)
    assert h.abort("x", 4)  # Abort before the Prefill arrived: tombstone, nothing written
    assert h.refuses("x", 4) and h.refuses("x", 3) and not h.refuses("x", 5)
    h.record("y", 1, drained=False)
    assert not h.abort("y", 1) and h.abort("y", 0)  # the failed write is not drained; older ones are
    h.record("y", 0, drained=True)  # an older generation never moves the state back
    assert not h.abort("y", 1)
    with pytest.raises(ValueError, match="ttl_s"):
        PrefillHistory(ttl_s=0)


def test_transfer_timeline_counts_overlapping_writes_once_and_what_outlived_compute():
    from glmserve.services.prefill.stage_job import StageOutcome
    from glmserve.services.prefill.transfer_timeline import TransferTimeline

    stage0 = StageOutcome(True, computed_at=5.0, writes=((1.0, 2.0, 10), (4.0, 6.0, 10)))
    stage1 = StageOutcome(True, computed_at=8.0, writes=((1.5, 3.0, 5), (7.5, 9.0, 5)))
    t = TransferTimeline.of([stage0, stage1])
    assert (t.busy_s, t.exposed_s, t.num_bytes) == (2.0 + 2.0 + 1.5, 1.0, 30)  # [1,3] + [4,6] + [7.5,9]
    assert abs(t.hidden - (1 - 1.0 / 5.5)) < 1e-12
    assert TransferTimeline.of([StageOutcome(True, computed_at=1.0)]).hidden == 1.0
