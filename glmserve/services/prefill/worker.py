"""PrefillWorker: computes a prompt's KV on its engine and writes it into a decode worker's blocks.

Transport-free: the gRPC servicer is a thin adapter over ``prefill``, ``abort`` and ``health``.
One job per (request id, generation), each its own asyncio task (a caller that goes away aborts
the job, it never cuts it short):

1. connect to the decode worker's transfer target (cached by the backend);
2. load (with a host tier, `HostTierLink`): prompt blocks found only on the kvstore's host tier are
   loaded into this worker's blocks, so the engine finds them as prefix-cache hits;
   compute: ``engine.add_request(..., max_tokens=1, hold_blocks=True)``; the request's stream
   ends with what the engine kept (`HeldPrefill`: the blocks, the first token, the MTP seed);
3. transfer: one ``transfer.write`` of the prompt's blocks into ``dest_block_ids`` with the stamp
   (request id, generation, checksum when asked), awaited until final;
4. release the source blocks (to the prefix cache) once the write is final, record the outcome
   in `PrefillHistory`, and answer with the first token, the MTP seed and the stamp.

Abort (``abort(request_id, generation)``, or the caller cancelling): the job is marked at once;
in load the host load is cancelled (its blocks are freed once the kvstore says it is drained);
in compute the engine drops the request (its blocks are free when the command runs); in transfer
the write is cancelled. ``abort`` returns only when the job has ended, with ``drained``: no more
bytes can land in the destination (False only when the writer could not confirm it, e.g. the
connection to the receiver died mid-write; the receiver then waits out the agreed timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmserve.core.generation import TokenEvent
from glmserve.kv.transfer import KVTransferBackend, TransferError, TransferHandle, TransferStamp
from glmserve.services.engine_host import EngineHost
from glmserve.services.host_metrics import HostTierMetrics
from glmserve.services.host_tier_link import HostTierLink, HostTierSettings, LoadAborted, Loaded
from glmserve.services.liveness import EngineWatch
from glmserve.services.prefill.history import DEFAULT_TTL_S, PrefillHistory
from glmserve.services.prefill.job import (
    AbortOutcome,
    PrefillAborted,
    PrefillError,
    PrefillFailed,
    PrefillJob,
    PrefillResult,
    check_job,
    drain_jobs,
)
from glmserve.services.prefill.write_control import request_cancel, wait_final
from glmserve.services.worker_health import WorkerHealth
from glmserve.services.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    import torch

    from glmserve.engine.engine import Engine
    from glmserve.engine.handoff import HeldPrefill

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    spec: PrefillJob
    key: str  # the engine's request id: one per generation
    stage: str = "connect"  # connect | load | compute | transfer
    abort_reason: str | None = None
    handle: TransferHandle | None = None
    drained: bool = True
    task: asyncio.Task[PrefillResult] | None = None


class PrefillWorker:
    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        transfer: KVTransferBackend,
        metrics: Callable[[EngineHost], WorkerMetrics] | None = None,
        history_ttl_s: float = DEFAULT_TTL_S,
        host_tier: HostTierSettings | None = None,
    ) -> None:
        """``metrics``: builds the worker's metrics from its engine thread (for snapshot gauges).
        ``host_tier``: use the kvstore's host tier (load-back before prefill, write-through, demotion)."""
        self._engine = EngineHost(engine_factory, "prefill-engine")
        self._watch = EngineWatch(self._engine)
        self.metrics = metrics(self._engine) if metrics is not None else None
        self.host_metrics = HostTierMetrics(self.metrics.registry) if self.metrics is not None else None
        self._host_tier = HostTierLink(host_tier, transfer, self._engine, self.host_metrics) if host_tier else None
        self._transfer = transfer
        self._history = PrefillHistory(history_ttl_s)
        self._jobs: dict[tuple[str, int], _Job] = {}
        self._by_key: dict[str, _Job] = {}
        self._background: set[asyncio.Task[object]] = set()
        self._buffer: torch.Tensor | None = None
        self._draining = self._closing = False

    @property
    def engine(self) -> EngineHost:
        return self._engine

    async def start(self) -> None:
        """Load the engine and register its KV buffer with the transfer backend."""
        self._engine.start()
        await self._engine.loaded()
        self._buffer = await self._engine.submit(lambda e: e.kv_buffer)
        self._transfer.register(self._buffer)
        if self._host_tier is not None:
            await self._host_tier.start(self._buffer)

    def ready(self) -> bool:
        """Requests may be sent here (loaded, engine thread alive, not draining)."""
        return self.health().ready

    def live(self) -> bool:
        """The process can serve: its engine thread is alive and not stuck (`EngineWatch`)."""
        return self._watch.live()

    def health(self) -> WorkerHealth:
        s = self._engine.snapshot
        ready = s.loaded and self._engine.alive and not (self._draining or self._closing)
        # The snapshot is taken between engine steps, so a prompt computed in one step would never
        # show as running there; the job table holds every accepted job from its start to its end.
        running = max(s.running + s.held, len(self._jobs) - s.waiting)
        return WorkerHealth(ready, running, s.waiting, s.free_blocks, s.cache_root, s.block_size)

    # --- prefill ----------------------------------------------------------------------------------

    async def prefill(self, spec: PrefillJob) -> PrefillResult:
        """Run a job (see the module docstring). Raises ``ValueError`` for a bad job,
        ``PrefillAborted`` / ``PrefillFailed`` when it ends without a result."""
        self._validate(spec)
        ident = (spec.request_id, spec.generation)
        if ident in self._jobs:  # not "drained": the running job may still write there
            raise PrefillFailed(f"request {spec.request_id!r} generation {spec.generation} is already "
                                "running", drained=False)
        if self._history.refuses(*ident):
            raise PrefillAborted(f"request {spec.request_id!r} generation {spec.generation} was "
                                 "already aborted, finished or superseded", drained=True)
        key = f"{spec.request_id}@{spec.generation}"
        job = _Job(spec, key)
        self._jobs[ident], self._by_key[key] = job, job
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        job.task = asyncio.create_task(self._run(job))
        try:
            return await asyncio.shield(job.task)
        except asyncio.CancelledError:  # the caller went away: abort the job, do not cut it short
            if not job.task.done():
                self._abort_in_background(spec.request_id, spec.generation)
            raise

    def _validate(self, spec: PrefillJob) -> None:
        if self._closing:
            raise PrefillFailed("the prefill worker is shutting down", drained=True)
        check_job(spec, self._transfer.kind, self._engine.snapshot.block_size)

    async def _run(self, job: _Job) -> PrefillResult:
        spec, drained = job.spec, True
        try:
            try:
                peer = await asyncio.to_thread(self._transfer.connect, spec.decode_target)
            except (TransferError, ValueError, OSError) as e:
                raise PrefillFailed(f"cannot connect to the decode worker's KV buffer: {e}", drained=True) from e
            self._raise_if_aborted(job)
            loaded = await self._load(job)
            job.stage = "compute"
            params = dataclasses.replace(spec.params, max_tokens=1, stop=())  # stop strings: decode's job
            prompt = list(spec.prompt_ids)
            salt = spec.cache_salt or None

            def add(e: Engine) -> object:
                add_it = lambda: e.add_request(job.key, prompt, params, hold_blocks=True,  # noqa: E731
                                               cache_salt=salt)
                return add_it() if loaded is None else loaded.apply(e, add_it)

            held = await self._compute(job, add)
            if self.metrics is not None and held.queue_s is not None:
                self.metrics.queue_time.observe(held.queue_s)
                self.metrics.prefill_time.observe(held.compute_s)
            if self.host_metrics is not None:
                host_blocks = 0 if loaded is None else loaded.host_blocks
                self.host_metrics.count_hits(held.output.num_cached_tokens,
                                             host_blocks * self._engine.snapshot.block_size)
            try:
                self._raise_if_aborted(job)
                job.stage = "transfer"
                return await self._send_kv(job, peer, held)
            finally:
                drained = job.handle is None or job.handle.drained
                self._engine.submit_nowait(lambda e: e.release(job.key))  # the write is final here
        except PrefillError as e:
            drained = e.drained
            raise
        finally:
            job.drained = drained
            self._history.record(spec.request_id, spec.generation, drained)
            del self._jobs[(spec.request_id, spec.generation)], self._by_key[job.key]

    async def _compute(self, job: _Job, add: Callable[[Engine], object]) -> HeldPrefill:
        """Run the prompt on the engine; what it kept once it finished (its blocks stay held
        until released). Raises `PrefillAborted` / `PrefillFailed` (drained: nothing was sent)."""
        stream = self._engine.open(job.key, on_finish=_held_prefill)
        try:
            await self._engine.submit(add)
        except BaseException:
            stream.close()
            raise
        async for event in stream:
            final = event
        if final.finish_reason == "abort" or job.abort_reason is not None:
            raise PrefillAborted(f"aborted ({job.abort_reason or final.error})", drained=True)
        if stream.outcome is None:
            raise PrefillFailed(final.error or "the engine kept no prefill", drained=True)
        return stream.outcome

    async def _send_kv(self, job: _Job, peer: str, held: HeldPrefill) -> PrefillResult:
        spec = job.spec
        src, dst = held.block_ids[: len(spec.dest_block_ids)], list(spec.dest_block_ids)
        stamp = TransferStamp(spec.request_id, spec.generation)
        if spec.checksum:  # the held source rows do not change until we release them
            stamp = await asyncio.to_thread(stamp.with_checksum, self._buffer, src)
            self._raise_if_aborted(job)
        try:
            job.handle = handle = self._transfer.write(peer, stamp, src, dst)
        except TransferError as e:  # the write did not start: nothing was sent
            raise PrefillFailed(f"KV transfer could not start: {e}", drained=True) from e
        await wait_final(handle)
        m = self.metrics
        if handle.state == "done":
            if m is not None:
                m.transfer_bytes.inc(handle.num_bytes)
                m.transfer_seconds.observe((handle.finished_at or handle.started) - handle.started)
            self._raise_if_aborted(job)  # done before the cancel landed: drained, but unwanted
            return PrefillResult(held.output, stamp)
        if job.abort_reason is not None:
            raise PrefillAborted(f"aborted during transfer ({job.abort_reason})", drained=handle.drained)
        if m is not None:
            m.transfer_failed("writer")
        raise PrefillFailed(f"KV transfer failed: {handle.error}", drained=handle.drained)

    async def _load(self, job: _Job) -> Loaded | None:
        """Load-back of the prompt's host-only blocks; None when there is none (or it failed: the
        prompt is then computed). Raises `PrefillAborted` when the job was aborted meanwhile, with
        everything the load held given back."""
        if self._host_tier is None or not self._host_tier.ready:
            return None
        job.stage = "load"
        try:
            loaded = await self._host_tier.load(job.key, job.spec.generation, job.spec.prompt_ids,
                                           salt=job.spec.cache_salt or None)
        except LoadAborted as e:
            log.info("%s: no host blocks: %s", job.key, e)
            loaded = None
        if loaded is not None and job.abort_reason is not None:
            self._host_tier.release(job.key)  # the load finished (drained) before the abort reached it
        self._raise_if_aborted(job)
        return loaded

    @staticmethod
    def _raise_if_aborted(job: _Job) -> None:
        if job.abort_reason is not None:
            raise PrefillAborted(f"aborted ({job.abort_reason})", drained=True)

    # --- abort ------------------------------------------------------------------------------------

    async def abort(self, request_id: str, generation: int, reason: str, label: str = "abort_rpc") -> AbortOutcome:
        """Stop the job now; returns once it has ended (see the module docstring). ``label``: the
        metrics' reason (a small fixed set; ``reason`` is free text for logs and errors)."""
        job = self._jobs.get((request_id, generation))
        if job is None:
            return AbortOutcome(found=False, drained=self._history.abort(request_id, generation))
        if job.abort_reason is None:
            job.abort_reason = reason or "abort"
            log.info("aborting %s in %s: %s", job.key, job.stage, reason)
            if self.metrics is not None:
                self.metrics.abort(job.stage, label)
            if job.handle is not None:
                request_cancel(self._transfer, job.handle)
            elif job.stage == "load" and self._host_tier is not None:
                self._cancel_load_in_background(job)
            elif job.stage == "compute":
                self._engine.abort(job.key, reason)  # frees the blocks when it runs; ends the stream
        assert job.task is not None
        await asyncio.wait([job.task])
        return AbortOutcome(found=True, drained=job.drained)

    def _cancel_load_in_background(self, job: _Job) -> None:
        assert self._host_tier is not None
        task = asyncio.create_task(self._host_tier.cancel(job.key, job.spec.generation))
        self._background.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._background.discard)

    def _abort_in_background(self, request_id: str, generation: int) -> None:
        task = asyncio.create_task(self.abort(request_id, generation, "caller cancelled", "caller_cancelled"))
        self._background.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float, settle_s: float = 1.5) -> int:
        """Health says not ready from now on, so routers stop choosing this worker; then
        `drain_jobs`. Returns how many jobs still run (`close` aborts them)."""
        self._draining = True
        return await drain_jobs(lambda: len(self._jobs), timeout_s, settle_s)

    async def close(self) -> None:
        """Abort every job (drained or failed), then stop the engine and the transfer backend."""
        self._closing = True
        await asyncio.gather(*(self.abort(r, g, "shutdown", "shutdown") for r, g in list(self._jobs)))
        if self._host_tier is not None:
            await self._host_tier.close()
        await self._engine.stop()
        self._transfer.close()


def _held_prefill(engine: Engine, final: TokenEvent) -> HeldPrefill | None:
    """On the engine thread, right after the request finished: what it kept."""
    return engine.held_prefill(final.request_id) if final.finish_reason in ("stop", "length") else None

