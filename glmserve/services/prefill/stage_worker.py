"""StageWorker: one LayerSplit stage's part of every prefill job (transport-free; the gRPC servicer
and the head's coordinator are thin callers).

A job on a stage (the head tells every stage the same thing, `StagedPrefill`):

1. ``begin``: connect to the decode worker's KV buffer with this stage's window (its slice of every
   whole-model block), find the cached prefix in this stage's pool; returns its length.
2. ``admit(num_cached, chunk_tokens, stream)``: allocate; stage 0 queues every chunk on its engine
   at once, the others wait for ``chunk`` calls from the previous stage.
3. each chunk computed: when `kv_writes` says so, write the blocks it completed into the decode
   worker's blocks (stamped with a `StampPart`: stage, chunk, blocks, bytes), and hand the outputs
   to the next stage (a receive slot there, one write of a packed row, then ``chunk``), in order, on
   a sender task, while the engine goes on with the next chunk.
4. ``finish`` answers when the job has ended here: every chunk computed and passed on, every write
   final (the last stage's answer carries the first token). Then the blocks are released to the
   prefix cache (or freed), never before every write from them is final (DESIGN invariant 2).

``abort`` (the head's fan-out, the head's Finish call going away, or the job timeout) stops the
job at once: queued chunks are skipped, writes cancelled; it answers once they are final, with
``drained``. `PrefillHistory` refuses a late Begin for a job that already ended (DESIGN invariant 3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from glmserve.engine.stage_engine import ChunkOutput, chunk_spans, kv_writes
from glmserve.kv.transfer import (
    BlockWindow,
    KVTransferBackend,
    StampPart,
    TransferError,
    TransferHandle,
    TransferStamp,
)
from glmserve.services.engine_host import EngineHost
from glmserve.services.host_metrics import HostTierMetrics
from glmserve.services.host_tier_link import HostTierLink, HostTierSettings, LoadAborted, Loaded
from glmserve.services.liveness import EngineWatch
from glmserve.services.prefill.activations import ActivationShape, ActivationSlots
from glmserve.services.prefill.chunk_link import ChunkReceiver, ChunkSender
from glmserve.services.prefill.history import PrefillHistory
from glmserve.services.prefill.job import AbortOutcome, drain_jobs
from glmserve.services.prefill.stage_job import NextStage, StageJobSpec, StageOutcome, StageSettings
from glmserve.services.prefill.stage_state import StageJobState, output_future
from glmserve.services.prefill.write_control import request_cancel, wait_final

if TYPE_CHECKING:
    import torch

    from glmserve.engine.stage_engine import StageEngine

log = logging.getLogger(__name__)

LINGER_S = 60.0  # an ended job nobody asked about is forgotten after this


class StageWorker:
    def __init__(self, engine_factory: Callable[[], StageEngine], kv_backend: KVTransferBackend,
                 activation_backend: KVTransferBackend, settings: StageSettings,
                 next_stage: NextStage | None, host: HostTierSettings | None = None,
                 host_metrics: HostTierMetrics | None = None) -> None:
        """``host``: this stage's slices of the kvstore's host tier (load-back, write-through), counted
        in ``host_metrics`` when given (the head's: the only stage with a metrics endpoint)."""
        self._engine = EngineHost(engine_factory, name=f"stage-{settings.index}-engine")
        self._watch = EngineWatch(self._engine)
        self._kv, self._act = kv_backend, activation_backend
        self.settings, self._next = settings, next_stage
        self._jobs: dict[tuple[str, int], StageJobState] = {}
        self._history = PrefillHistory()
        self._background: set[asyncio.Task[object]] = set()
        self._slots: ActivationSlots | None = None
        self._sender: ChunkSender | None = None
        self._receiver: ChunkReceiver | None = None
        part = (settings.index, settings.num_stages) if settings.num_stages > 1 else None
        self._host = HostTierLink(host, kv_backend, self._engine, host_metrics, part=part) if host is not None else None
        self._window: BlockWindow | None = None
        self._buffer: torch.Tensor | None = None
        self.activation_target = b""
        self._draining = self._closing = False

    @property
    def engine(self) -> EngineHost:
        return self._engine

    async def start(self) -> None:
        """Load the stage's engine; register its KV buffer and its activation slots."""
        self._engine.start()
        await self._engine.loaded()

        self._buffer, g = await self._engine.submit(lambda e: (e.kv_buffer, e.geometry()))
        shape = ActivationShape(self.settings.chunk_tokens, g.hidden_size, g.dtype, g.index_topk)
        self._window, whole = BlockWindow(0, g.block_offset, g.block_bytes), g.whole_block_bytes
        self._kv.register(self._buffer)
        if self._host is not None:  # our rows: a slice of the host tier's whole-model blocks
            sliced = whole != self._window.length
            await self._host.start(self._buffer, self._window.dst_offset if sliced else 0, whole if sliced else 0)
        self._slots = ActivationSlots(shape, self.settings.slots, self.settings.slots)
        self._act.register(self._slots.buffer)
        if self._next is not None:
            self._sender = ChunkSender(self.settings, self._act, self._slots, self._next)
        if self.settings.index > 0:
            self._receiver = ChunkReceiver(self.settings.index, self._slots, self._act)
        self.activation_target = self._act.target_info()

    def ready(self) -> bool:
        """The head may send jobs (loaded, engine thread alive, not draining or closing)."""
        return self._slots is not None and self._engine.alive and not (self._draining or self._closing)

    def live(self) -> bool:
        """The process can serve: its engine thread is alive and not stuck (`EngineWatch`)."""
        return self._watch.live()

    async def drain(self, timeout_s: float, settle_s: float = 1.5) -> int:
        """Not ready from now on (the head's Health follows, so routers stop choosing the replica);
        the jobs it has, and those the head still sends, run meanwhile (`drain_jobs`)."""
        self._draining = True
        return await drain_jobs(lambda: len(self._jobs), timeout_s, settle_s)

    @property
    def running(self) -> int:
        return len(self._jobs)

    # --- the head's calls -------------------------------------------------------------------------

    async def begin(self, spec: StageJobSpec) -> int:
        """Raises ValueError for a bad or duplicate job, `TransferError` when the decode worker's
        buffer cannot be reached."""
        ident = (spec.request_id, spec.generation)
        if self._closing:
            raise TransferError("the stage is shutting down")
        if ident in self._jobs or self._history.refuses(*ident):
            raise ValueError(f"request {spec.request_id!r} generation {spec.generation} is running or ended here")
        peer = await asyncio.to_thread(self._kv.connect, spec.decode_target, self._window)
        if ident in self._jobs or self._history.refuses(*ident):  # an Abort overtook this Begin
            raise ValueError(f"request {spec.request_id!r} generation {spec.generation} was aborted here")
        loop = asyncio.get_running_loop()
        job = StageJobState(spec, peer, loop.create_future())
        self._jobs[ident] = job
        job.timer = loop.call_later(self.settings.job_timeout_s, self._abort_in_background, *ident,
                                    "stage job timed out")
        try:
            loaded = await self._load(job)
            if job.ending:  # aborted during the load
                if loaded is not None:
                    self._host.release(loaded.key)
                raise ValueError(f"request {spec.request_id!r} generation {spec.generation} was aborted here")

            def begin(e: StageEngine) -> int:
                start = lambda: e.begin(spec.key, list(spec.prompt_ids), spec.params, spec.cache_salt or None)  # noqa: E731
                return start() if loaded is None else loaded.apply(e, start)

            return await self._engine.submit(begin)
        except BaseException:
            if not job.ending:
                self._drop(job)
            raise

    def _load_key(self, job: StageJobState) -> str:
        """Every stage loads its own slices of the same blocks at once: one load id each."""
        return f"{job.spec.key}#stage{self.settings.index}"

    async def _load(self, job: StageJobState) -> Loaded | None:
        """This stage's slices of the prompt's host-only blocks, loaded into its blocks (None: none,
        or the load failed: the prompt is then computed)."""
        if self._host is None or not self._host.ready:
            return None
        job.loading = True
        try:
            return await self._host.load(self._load_key(job), job.spec.generation, job.spec.prompt_ids,
                                         salt=job.spec.cache_salt or None)
        except LoadAborted as e:
            log.info("%s: no host blocks: %s", job.spec.key, e)
            return None
        finally:
            job.loading = False

    async def admit(self, request_id: str, generation: int, num_cached: int, chunk_tokens: int, stream: bool) -> None:
        """Raises `OutOfBlocks` (nothing held then) or ValueError."""
        job = self._job(request_id, generation)
        if chunk_tokens != self.settings.chunk_tokens:
            raise ValueError(f"chunk_tokens: {chunk_tokens} != this stage's slots of {self.settings.chunk_tokens}")
        try:
            await self._engine.submit(lambda e: e.admit(job.spec.key, num_cached))
        except BaseException:
            if not job.ending:
                self._drop(job)
            raise
        if job.ending:  # aborted while the blocks were allocated: its settling frees them
            raise ValueError(f"request {request_id!r} generation {generation} was aborted here")
        n, bs = len(job.spec.prompt_ids), self._engine.snapshot.block_size
        spans = chunk_spans(num_cached, n, chunk_tokens)
        job.num_chunks = len(spans)
        plan = kv_writes(num_cached, n, chunk_tokens, bs, stream)
        job.writes = {chunk: (w, blocks) for w, (chunk, blocks) in enumerate(plan)}
        job.settled.set()  # the previous stage's chunks may arrive before our Admit did
        if self.settings.index == 0:
            for i, (start, count) in enumerate(spans):
                self._compute(job, i, start, count, None, None)
        if not self.settings.is_last:
            self._spawn(job, self._send_all(job))

    async def finish(self, request_id: str, generation: int) -> StageOutcome:
        """Waits until the job has ended here; then forgets it."""
        job = self._job(request_id, generation)
        outcome = await asyncio.shield(job.outcome)
        self._forget(job)
        return outcome

    async def abort(self, request_id: str, generation: int, reason: str) -> AbortOutcome:
        """Stop the job now; returns once every write of it is final."""
        job = self._jobs.get((request_id, generation))
        if job is None:
            return AbortOutcome(found=False, drained=self._history.abort(request_id, generation))
        if not job.ending:
            log.info("stage %d: aborting %s: %s", self.settings.index, job.spec.key, reason)
            self._stop(job, StageOutcome(False, f"aborted ({reason or 'abort'})"))
        outcome = await asyncio.shield(job.outcome)
        self._forget(job)
        return AbortOutcome(found=True, drained=outcome.drained)

    # --- from the previous stage --------------------------------------------------------------------

    async def slot(self, request_id: str, generation: int, chunk: int) -> int:
        job = self._job(request_id, generation)
        assert self._receiver is not None
        return await self._receiver.grant(job.recv_slots, lambda: not job.ending)

    async def chunk(self, request_id: str, generation: int, chunk: int, slot: int, start: int, num_tokens: int,
                    topk_width: int, stamp: bytes) -> None:
        """Chunk ``chunk`` landed in receive ``slot``: check its stamp, copy it out, compute it."""
        job = self._job(request_id, generation)
        assert self._receiver is not None
        hidden, topk = await self._receiver.take(job.recv_slots, request_id, generation, chunk, slot, num_tokens,
                                                 topk_width, stamp)
        await job.settled.wait()
        if job.ending:
            raise ValueError(f"request {request_id!r} generation {generation} has ended on this stage")
        self._compute(job, chunk, start, num_tokens, hidden, topk)

    # --- computing and shipping -------------------------------------------------------------------

    def _compute(self, job: StageJobState, i: int, start: int, n: int, hidden: torch.Tensor | None,
                 topk: torch.Tensor | None) -> None:
        key, write = job.spec.key, job.writes.get(i)

        def run(e: StageEngine) -> tuple[ChunkOutput, list[int]] | None:
            if job.stopped is not None:  # stopped while queued: skip the compute
                return None
            out = e.run_chunk(key, start, n, hidden, topk)
            return out, (e.block_ids(key, write[1]) if write is not None else [])

        future = self._engine.submit(run)
        self._spawn(job, self._after(job, i, start, future))

    async def _after(self, job: StageJobState, i: int, start: int, future: asyncio.Future) -> None:
        try:
            result = await future
        except Exception as e:  # the engine failed the chunk (a bug or a bad input): fail the job
            self._stop(job, StageOutcome(False, f"stage {self.settings.index} chunk {i} failed: {e!r}"))
            return
        if result is None or job.stopped is not None:
            return
        out, src = result
        if out.handoff is not None:
            job.handoff = out.handoff
        if not self.settings.is_last:
            output_future(job, i).set_result((start, out))
        job.computed += 1
        if job.computed == job.num_chunks:
            job.computed_at = time.monotonic()
        if i in job.writes:
            await self._write_kv(job, job.writes[i], src)
        self._maybe_done(job)

    async def _write_kv(self, job: StageJobState, write: tuple[int, range], src: list[int]) -> None:
        w, blocks = write
        spec, s = job.spec, self.settings
        assert self._window is not None and self._buffer is not None
        part = StampPart(s.index, s.num_stages, w, len(job.writes), blocks.start, len(blocks),
                         self._window.dst_offset, self._window.length)
        stamp = TransferStamp(spec.request_id, spec.generation, part=part)
        if spec.checksum:  # over whole rows of this stage: exactly the window's bytes at decode
            stamp = await asyncio.to_thread(stamp.with_checksum, self._buffer, src)
        if job.ending:
            return
        try:
            handle = self._kv.write(job.peer, stamp, src, list(spec.dest_block_ids[blocks.start : blocks.stop]))
        except (TransferError, ValueError) as e:
            self._stop(job, StageOutcome(False, f"stage {s.index}: KV write could not start: {e}"))
            return
        job.kv_handles.append(handle)
        self._track(job, handle)

    def _track(self, job: StageJobState, handle: TransferHandle) -> None:
        job.handles.append(handle)

        async def watch() -> None:
            await wait_final(handle)
            if handle.state != "done":
                self._stop(job, StageOutcome(False, f"stage {self.settings.index}: transfer failed: {handle.error}"))
            self._maybe_done(job)

        self._spawn(job, watch())

    async def _send_all(self, job: StageJobState) -> None:
        """The sender: each computed chunk's outputs to the next stage, in order."""
        assert self._sender is not None
        spec = job.spec
        for i in range(job.num_chunks):
            start, out = await output_future(job, i)
            if job.stopped is not None:
                return
            try:
                await self._sender.send(spec, i, start, out, job.num_chunks, lambda: not job.ending,
                                        job.handles.append)
            except Exception as e:  # the next stage is gone or refused: the head aborts the others
                self._stop(job, StageOutcome(False, f"stage {self.settings.index}: sending chunk {i} of "
                                                    f"{spec.key} failed: {e}"))
                return
            job.sent += 1
            self._maybe_done(job)

    # --- ending -----------------------------------------------------------------------------------

    def _maybe_done(self, job: StageJobState) -> None:
        sent = self.settings.is_last or job.sent == job.num_chunks
        written = len(job.kv_handles) == len(job.writes)  # every write started (a checksum may delay one)
        if (job.num_chunks and job.computed == job.num_chunks and sent and written
                and all(h.state == "done" for h in job.handles)):
            writes = tuple((h.started, h.finished_at or h.started, h.num_bytes) for h in job.kv_handles)
            self._end(job, StageOutcome(True, handoff=job.handoff, computed_at=job.computed_at, writes=writes))

    def _stop(self, job: StageJobState, outcome: StageOutcome) -> None:
        """End early (abort, failure): skip queued chunks, cancel what is in flight."""
        if job.ending:
            return
        job.stopped = outcome.error
        if job.loading and self._host is not None:
            self._spawn(job, self._host.cancel(self._load_key(job), job.spec.generation))
        for handle in job.handles:
            if handle.state == "pending":
                request_cancel(self._backend_of(handle), handle)
        self._end(job, outcome)

    def _end(self, job: StageJobState, outcome: StageOutcome) -> None:
        """Once: no write starts any more; when every write is final, release the blocks and
        settle the outcome."""
        if job.ending:
            return
        job.ending = True
        job.settled.set()
        if job.timer is not None:
            job.timer.cancel()
        self._spawn(job, self._settle(job, outcome))

    async def _settle(self, job: StageJobState, outcome: StageOutcome) -> None:
        for handle in list(job.handles):
            await wait_final(handle)
        for task in list(job.tasks):  # a sender waiting for chunks that will not come
            if task is not asyncio.current_task():
                task.cancel()
        drained = all(h.drained for h in job.handles)
        ok = outcome.ok and all(h.state == "done" for h in job.handles)
        key = job.spec.key
        await self._engine.submit(lambda e: e.release(key) if ok else e.abort(key))
        if self._receiver is not None:
            self._receiver.release_later(job.recv_slots)
        self._history.record(job.spec.request_id, job.spec.generation, drained)
        if not ok and outcome.ok:
            outcome = StageOutcome(False, "a write failed", drained)
        job.outcome.set_result(outcome if ok else StageOutcome(False, outcome.error, drained))
        asyncio.get_running_loop().call_later(LINGER_S, self._forget, job)  # nobody asked: forget it anyway

    def _backend_of(self, handle: TransferHandle) -> KVTransferBackend:
        sent = self._sender is not None and handle.peer == self._sender.peer
        return self._act if sent else self._kv

    def _drop(self, job: StageJobState) -> None:
        """Forget a job that never got going (begin or admit failed): nothing of it was written."""
        job.ending = True
        job.settled.set()
        if job.timer is not None:
            job.timer.cancel()
        self._forget(job)
        self._history.record(job.spec.request_id, job.spec.generation, True)
        job.outcome.set_result(StageOutcome(False, "the job did not start"))
        key = job.spec.key
        self._engine.submit_nowait(lambda e: e.abort(key))

    def _forget(self, job: StageJobState) -> None:
        ident = (job.spec.request_id, job.spec.generation)
        if self._jobs.get(ident) is job:
            del self._jobs[ident]

    def _job(self, request_id: str, generation: int) -> StageJobState:
        job = self._jobs.get((request_id, generation))
        if job is None:
            raise KeyError(f"request {request_id!r} generation {generation} is not running on this stage")
        return job

    def _spawn(self, job: StageJobState, coro) -> None:
        task = asyncio.create_task(coro)
        job.tasks.add(task)
        task.add_done_callback(job.tasks.discard)

    def _abort_in_background(self, request_id: str, generation: int, reason: str) -> None:
        task = asyncio.create_task(self.abort(request_id, generation, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        self._closing = True
        await asyncio.gather(*(self.abort(r, g, "shutdown") for r, g in list(self._jobs)))
        if self._host is not None:
            await self._host.close()
        await self._engine.stop()
        self._kv.close()
        self._act.close()
