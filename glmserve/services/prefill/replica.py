"""StagedPrefill: the head (stage 0) of a LayerSplit prefill replica, serving Prefill to decode
workers as a one-process `PrefillWorker` does, with the job spread over the replica's stages.

One job per (request id, generation), its own asyncio task:

1. Begin on every stage at once; each finds the prompt's cached prefix in its own pool. The
   replica's hit is the shortest one (a block counts only when every stage holds its slice), so
   ``num_cached_tokens`` and what the router was told stay exact.
2. Admit on every stage: the agreed prefix, the chunk size, and whether to stream (a prompt with
   at least ``stream_min_tokens`` tokens to compute: every stage writes its KV after each chunk;
   else each writes once, after the last). Stage 0 starts computing; each stage hands its chunk
   outputs to the next while computing the following chunk.
3. Finish on every stage (long calls, made at once): each answers when its part has ended; the
   last stage's answer carries the first token and the MTP seed. The answer to the decode worker
   names the stage count; decode admits the request only once every stage's every chunk write has
   arrived, each with its own stamp (`StampPart`).

Any failure, of any stage at any step (a call that fails, a stage that dies: its calls fail at
once), and any abort (the decode worker's Abort, its call going away, shutdown) aborts the job on
every stage at once (DESIGN invariant 4), and the answer says whether the destination is drained:
every stage confirmed it, or a stage that is gone had ``dead_stage_grace_s`` for its last bytes to
land (a dead writer writes nothing more; DESIGN invariant 2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from glmserve.kv.transfer import TransferStamp
from glmserve.services.prefill.history import DEFAULT_TTL_S, PrefillHistory
from glmserve.services.prefill.job import (
    AbortOutcome,
    PrefillAborted,
    PrefillFailed,
    PrefillJob,
    PrefillResult,
    check_job,
    drain_jobs,
)
from glmserve.services.prefill.stage_client import LocalStage, StageCallError, StagePort
from glmserve.services.prefill.stage_job import DEFAULT_STREAM_MIN_TOKENS, StageJobSpec, StageOutcome
from glmserve.services.prefill.stage_worker import StageWorker
from glmserve.services.prefill.transfer_timeline import TimelineMetrics, TransferTimeline
from glmserve.services.worker_health import WorkerHealth
from glmserve.services.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaSettings:
    transfer_kind: str
    chunk_tokens: int = 2048
    stream_min_tokens: int = DEFAULT_STREAM_MIN_TOKENS
    dead_stage_grace_s: float = 1.0  # a gone stage: until its last bytes surely landed
    health_interval_s: float = 0.5  # how often the head checks the other stages

    def __post_init__(self) -> None:
        if self.dead_stage_grace_s < 0 or self.health_interval_s <= 0:
            raise ValueError("dead_stage_grace_s: must be >= 0 and health_interval_s > 0")


@dataclass(eq=False)
class _Job:
    spec: PrefillJob
    abort_reason: str | None = None
    drained: bool = True
    task: asyncio.Task[PrefillResult] | None = None


class StagedPrefill:
    def __init__(self, local: StageWorker, others: list[StagePort], settings: ReplicaSettings,
                 metrics: WorkerMetrics | None = None, history_ttl_s: float = DEFAULT_TTL_S) -> None:
        """``others``: stages 1 .. N-1 of the replica, in order."""
        self._local, self._stages = local, [LocalStage(local), *others]
        self._settings, self.metrics = settings, metrics
        self._timeline = TimelineMetrics(metrics.registry) if metrics is not None else None
        self._history = PrefillHistory(history_ttl_s)
        self._jobs: dict[tuple[str, int], _Job] = {}
        self._background: set[asyncio.Task[object]] = set()
        self._stages_ready = not others
        self._watch: asyncio.Task[None] | None = None
        self._draining = self._closing = False

    @property
    def engine(self):
        return self._local.engine

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    async def start(self) -> None:
        await self._local.start()
        if len(self._stages) > 1:
            self._watch = asyncio.create_task(self._watch_stages())

    async def _watch_stages(self) -> None:
        while True:
            answers = await asyncio.gather(*(s.ready() for s in self._stages[1:]))
            if all(answers) != self._stages_ready:
                log.info("LayerSplit replica: stages %s", "all ready" if all(answers) else f"not ready: {answers}")
            self._stages_ready = all(answers)
            await asyncio.sleep(self._settings.health_interval_s)

    def ready(self) -> bool:
        """Decode workers may send prompts: every stage is ready, and the head is not draining."""
        return self.health().ready

    def live(self) -> bool:
        """This stage's process can serve (another stage's death makes the replica not ready, not
        this process dead: it comes back on its address)."""
        return self._local.live()

    async def drain(self, timeout_s: float, settle_s: float = 1.5) -> int:
        """Not ready from now on; the jobs running, and those still routed here for ``settle_s``,
        finish (`drain_jobs`). Returns how many still run (`close` aborts them on every stage)."""
        self._draining = True
        return await drain_jobs(lambda: len(self._jobs), timeout_s, settle_s)

    def health(self) -> WorkerHealth:
        s = self._local.engine.snapshot
        ready = self._local.ready() and self._stages_ready and not (self._draining or self._closing)
        return WorkerHealth(ready, len(self._jobs), 0, s.free_blocks, s.cache_root, s.block_size)

    # --- prefill ----------------------------------------------------------------------------------

    async def prefill(self, spec: PrefillJob) -> PrefillResult:
        """As `PrefillWorker.prefill`: ``ValueError`` for a bad job, `PrefillAborted` /
        `PrefillFailed` when it ends without a result."""
        if self._closing:
            raise PrefillFailed("the prefill replica is shutting down", drained=True)
        check_job(spec, self._settings.transfer_kind, self._local.engine.snapshot.block_size)
        ident = (spec.request_id, spec.generation)
        if ident in self._jobs:
            raise PrefillFailed(f"request {spec.request_id!r} generation {spec.generation} is already running",
                                drained=False)
        if self._history.refuses(*ident):
            raise PrefillAborted(f"request {spec.request_id!r} generation {spec.generation} was already aborted, "
                                 "finished or superseded", drained=True)
        job = _Job(spec)
        self._jobs[ident] = job
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        job.task = asyncio.create_task(self._run(job))
        try:
            return await asyncio.shield(job.task)
        except asyncio.CancelledError:  # the caller went away: abort the job, do not cut it short
            if not job.task.done():
                self._in_background(self.abort(spec.request_id, spec.generation, "caller cancelled",
                                               "caller_cancelled"))
            raise

    async def _run(self, job: _Job) -> PrefillResult:
        spec, s = job.spec, self._settings
        rid, gen = spec.request_id, spec.generation
        stage_spec = StageJobSpec(rid, gen, spec.prompt_ids, spec.params, spec.decode_target, spec.dest_block_ids,
                                  spec.checksum, spec.cache_salt)
        arrived = time.monotonic()
        try:
            hits = await self._on_all(job, "begin", lambda p: p.begin(stage_spec))
            num_cached = min(hits)
            stream = len(spec.prompt_ids) - num_cached >= s.stream_min_tokens
            await self._on_all(job, "admit", lambda p: p.admit(rid, gen, num_cached, s.chunk_tokens, stream))
            admitted = time.monotonic()
            outcomes: list[StageOutcome] = await self._on_all(job, "finish", lambda p: p.finish(rid, gen))
            job.drained = job.drained and all(o.drained for o in outcomes)
            failed = [o.error for o in outcomes if not o.ok]
            if failed or job.abort_reason is not None:
                self._raise(job, failed[0] if failed else "aborted")
            handoff = outcomes[-1].handoff
            if handoff is None:
                raise PrefillFailed("the last stage ended without a first token", drained=True)
            self._observe(outcomes, admitted - arrived, time.monotonic() - admitted)
            output = dataclasses.replace(handoff, num_cached_tokens=num_cached)
            return PrefillResult(output, TransferStamp(rid, gen), num_stages=len(self._stages))
        finally:
            self._history.record(rid, gen, job.drained)
            del self._jobs[(rid, gen)]

    def _observe(self, outcomes: list[StageOutcome], queue_s: float, compute_s: float) -> None:
        """Per request: the phase histograms, on the head's clock (every stage admitted it, then every
        stage finished: computed and written), and the transfer timeline across the stages."""
        if self.metrics is None or self._timeline is None:
            return
        self.metrics.queue_time.observe(queue_s)
        self.metrics.prefill_time.observe(compute_s)
        timeline = TransferTimeline.of(outcomes)
        self._timeline.observe(timeline)
        self.metrics.transfer_bytes.inc(timeline.num_bytes)
        for o in outcomes:
            for started, finished, _ in o.writes:
                self.metrics.transfer_seconds.observe(finished - started)

    async def _on_all(self, job: _Job, step: str, call: Callable[[StagePort], Awaitable[T]]) -> list[T]:
        """``call`` on every stage at once; the first failure aborts the job on every stage."""
        tasks = [asyncio.ensure_future(call(stage)) for stage in self._stages]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failure = next((t.exception() for t in tasks if t.done() and t.exception() is not None), None)
        if failure is None and job.abort_reason is None:
            return [t.result() for t in tasks]
        if failure is None:  # aborted while the calls ran: a stage may have begun after the abort reached it
            await self._abort_all(job, job.abort_reason)
            self._raise(job, "aborted")
        if job.abort_reason is None:
            log.warning("%s@%d: %s failed, aborting every stage: %s", job.spec.request_id, job.spec.generation,
                        step, failure)
            await self._abort_all(job, f"{step} failed on another stage: {failure}")
        await asyncio.wait(tasks)  # the others answer quickly once aborted
        for t in tasks:
            if not t.cancelled():
                t.exception()  # retrieved
        self._raise(job, str(failure))

    def _raise(self, job: _Job, error: str) -> None:
        if job.abort_reason is not None:
            raise PrefillAborted(f"aborted ({job.abort_reason})", drained=job.drained)
        raise PrefillFailed(error, drained=job.drained)

    async def _abort_all(self, job: _Job, reason: str) -> None:
        """Abort on every stage at once; ``job.drained`` says whether all confirmed it."""
        rid, gen = job.spec.request_id, job.spec.generation
        answers = await asyncio.gather(*(s.abort(rid, gen, reason) for s in self._stages))
        if any(a is None for a in answers):  # a dead stage's last bytes may still be landing
            await asyncio.sleep(self._settings.dead_stage_grace_s)
        job.drained = job.drained and all(a is not False for a in answers)

    # --- abort ------------------------------------------------------------------------------------

    async def abort(self, request_id: str, generation: int, reason: str, label: str = "abort_rpc") -> AbortOutcome:
        """Stop the job on every stage now; returns once it has ended (see the module docstring)."""
        job = self._jobs.get((request_id, generation))
        if job is None:
            return AbortOutcome(found=False, drained=self._history.abort(request_id, generation))
        if job.abort_reason is None:
            job.abort_reason = reason or "abort"
            log.info("aborting %s@%d on %d stages: %s", request_id, generation, len(self._stages), reason)
            if self.metrics is not None:
                self.metrics.abort("stages", label)
            await self._abort_all(job, job.abort_reason)
        assert job.task is not None
        await asyncio.wait([job.task])
        return AbortOutcome(found=True, drained=job.drained)

    def _in_background(self, coro: Awaitable[object]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Abort every job on every stage, then stop this stage."""
        self._closing = True
        await asyncio.gather(*(self.abort(r, g, "shutdown", "shutdown") for r, g in list(self._jobs)))
        if self._watch is not None:
            self._watch.cancel()
        for stage in self._stages[1:]:
            close = getattr(stage, "close", None)
            if close is not None:
                await close()
        await self._local.close()


__all__ = ["ReplicaSettings", "StageCallError", "StagedPrefill"]
