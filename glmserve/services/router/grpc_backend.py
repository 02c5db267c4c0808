"""DisaggregatedBackend: the router's `GenerationBackend` over prefill and decode workers (gRPC).

Per request: pick a decode worker (`WorkerPool`: load and free blocks) and a prefill worker
(`PrefixRouter`: the prompt's cached prefix per worker, from the kvstore index or the router's
local view, plus queued work, sessions and the herding guard), give the attempt a fresh
*generation*, open ``Decode.Generate`` naming the prefill worker; decode drives prefill and the KV
transfer and streams tokens back. The router itself only polls ``Health`` on the workers.

Failures, from the router's point of view:

- The call fails (UNAVAILABLE / RESOURCE_EXHAUSTED) before any event: nothing reached the client,
  so the request is retried on another decode worker with a new, larger generation (DESIGN
  invariant 3); with none left, `BackendFull` when every refusal was RESOURCE_EXHAUSTED (a full
  worker is not an unhealthy one: the router waits for capacity), else `WorkerUnreachable` (the
  router waits a moment and tries again within the queue wait, then 503).
- ABORTED before any event: the decode worker could not get the prompt prefilled (its channel to
  a restarted prefill worker still reconnecting, the transfer failed); the prefill worker is
  re-polled and `WorkerUnreachable` raised at once (the decode worker is not at fault).
- A decode worker dies mid-stream (or its stream ends with an error after tokens): the worker is
  marked failed (not chosen until a Health poll started afterwards answers ready) and the stream
  resumes on another decode worker (`stream_migration`: prompt plus the tokens sent so far, through
  prefill again; the client sees a pause), at most ``migration_limit`` times per request. Without
  a worker left, or past the limit, it ends at once with ``finish_reason="error"``.
- An error event from decode (e.g. its prefill worker died): that prefill worker is re-polled at
  once, so a dead one leaves the choice within a round trip instead of a poll interval.
- ``abort`` / the consumer leaving: the call is cancelled, which aborts the request in decode and
  prefill at once; an open stream ends with ``finish_reason="abort"``.
Nothing blocks the event loop (grpc.aio throughout). A kvstore that is down does not stop serving:
prefix lookups then use the router's local view (``/ready`` and ``glmserve_router_kv_index_up``
say so).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2 as kvstore_pb
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2_grpc as kvstore_grpc
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as prefill_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as prefill_grpc
from glmserve.services.generation_proto import event_from_proto, sampling_to_proto
from glmserve.services.router.backend import (
    BackendFull,
    BackendUnavailable,
    GenerationBackend,
    RequestHints,
    WorkerUnreachable,
)
from glmserve.services.router.local_prefill import LocalPrefill, LocalPrefillConfig
from glmserve.services.router.prefill_routing import RoutingConfig
from glmserve.services.router.prefix_router import PrefixRouter, RoutedPrefill
from glmserve.services.router.stream_migration import SentSoFar
from glmserve.services.router.worker_pool import HealthReport, WorkerPool, WorkerView
from glmserve.services.tracing import RequestSpan, Tracing

log = logging.getLogger(__name__)

# Reconnect quickly after a worker restarts (gRPC's default backoff grows to 120 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)


def _refused(refusals: list[grpc.aio.AioRpcError]) -> BackendUnavailable:
    """Every decode worker tried refused: full ones (RESOURCE_EXHAUSTED) mean "wait for capacity",
    anything else "try again in a moment"."""
    if all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refusals):
        return BackendFull(f"every decode worker is full: {refusals[-1].details()}")
    return WorkerUnreachable(f"decode workers refused the request: {refusals[-1].details()}")


def _error_event(request_id: str, message: str) -> TokenEvent:
    return TokenEvent.ended(request_id, "error", message)


@dataclass
class _PrefillHold:
    """Who computes an attempt's prompt: the routed prefill worker, or (``local``: the reason) the
    decode worker itself."""

    routed: RoutedPrefill
    decode: str
    local: str | None


@dataclass
class _Outcome:
    """How an attempt ended when it did not end with a final event (see `_relay`)."""

    refusal: grpc.aio.AioRpcError | None = None
    lost: str | None = None


@dataclass
class _Stream:
    """One running request: the live call (None between attempts) and whether it was aborted."""

    call: grpc.aio.UnaryStreamCall | None = None
    aborted: bool = False


class DisaggregatedBackend(GenerationBackend):
    """`GenerationBackend` over decode workers at ``decode`` and prefill workers at ``prefill``
    (``host:port`` each); see the module docstring. ``kvstore``: the block index service (prefix
    lookups; polled for its health). ``routing``: the prefill routing policy's settings.
    ``tracing``: spans of each request, passed on to decode in the call's metadata (off by default).
    ``migration_limit``: how often one stream may resume on another decode worker (0: never).
    Create and use it inside one event loop."""

    def __init__(
        self,
        decode: Sequence[str],
        prefill: Sequence[str],
        kvstore: str | None = None,
        *,
        poll_interval_s: float = 0.5,
        health_timeout_s: float = 1.0,
        max_attempts: int = 3,
        migration_limit: int = 3,
        routing: RoutingConfig | None = None,
        local_prefill: LocalPrefillConfig | None = None,
        tracing: Tracing | None = None,
    ):
        if poll_interval_s <= 0 or health_timeout_s <= 0 or max_attempts < 1 or migration_limit < 0:
            raise ValueError("poll_interval_s, health_timeout_s: must be > 0; max_attempts: >= 1; "
                             "migration_limit: >= 0")
        self.decode_pool = WorkerPool("decode", decode)
        self.prefill_pool = WorkerPool("prefill", prefill)
        self.kvstore_address = kvstore
        self.kvstore_up: bool | None = None  # None: not configured or not polled yet
        self._poll_interval_s, self._health_timeout_s = poll_interval_s, health_timeout_s
        self._max_attempts, self._migration_limit = max_attempts, migration_limit
        self._generations = itertools.count(1)  # later attempts get larger numbers
        self._streams: dict[str, _Stream] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # the poller and one-off re-polls
        self._started = self._closed = False
        self._tracing = tracing or Tracing()
        self.prefix_router = PrefixRouter(self.prefill_pool, routing or RoutingConfig(),
                                          lambda: self.kvstore_up)
        self.local_prefill = LocalPrefill(local_prefill or LocalPrefillConfig())

    # --- GenerationBackend ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        kvstore = [self.kvstore_address] if self.kvstore_address is not None else []
        for address in {*self.decode_pool.addresses, *self.prefill_pool.addresses, *kvstore}:
            self._channels[address] = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        if self.kvstore_address is not None:
            self.prefix_router.connect(self.kvstore_address)
        self._spawn(self._poll_forever())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for stream in self._streams.values():  # each open stream ends with "abort"
            stream.aborted = True
            if stream.call is not None:
                stream.call.cancel()
        await asyncio.sleep(0)  # let the streams see their cancellation before the channels go
        for channel in self._channels.values():
            await channel.close()
        await self.prefix_router.close()

    def ready(self) -> bool:
        return (self._started and not self._closed
                and self.decode_pool.any_healthy() and self.prefill_pool.any_healthy())

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.aborted = True
        if stream.call is not None:
            stream.call.cancel()  # decode sees the cancellation and aborts prefill and transfer

    def readiness_detail(self) -> dict[str, Any]:
        """For ``/ready``: where prefix lookups come from, and per role how many workers are healthy."""
        workers = {p.kind: {"healthy": sum(v.healthy for v in p.views()), "total": len(p.addresses)}
                   for p in (self.prefill_pool, self.decode_pool)}
        return {"prefix_index": self.prefix_router.index_source(), "workers": workers}

    def metrics_registry(self) -> Any:
        self.prefix_router.refresh_index_gauge()
        return self.prefix_router.metrics.registry

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        hints: RequestHints | None = None,
    ) -> AsyncIterator[TokenEvent]:
        if not self._started or self._closed:
            raise BackendUnavailable("the router is not connected to workers")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        stream = self._streams[request_id] = _Stream()
        span = self._tracing.start_request(request_id, prompt_tokens=len(prompt_ids))
        finished, error = False, None
        try:
            attempts = self._attempts(request_id, stream, prompt_ids, params, hints or RequestHints(), span)
            async with aclosing(attempts) as events:
                async for event in events:
                    finished = event.finished
                    if finished:
                        span.set(finish_reason=event.finish_reason)
                        error = event.error if event.finish_reason == "error" else None
                    yield event
        except BackendUnavailable as e:
            error = str(e)
            raise
        finally:
            if not finished:
                span.set(finish_reason="abort")  # the consumer left first
            span.end(error)
            self._streams.pop(request_id, None)
            if not finished and stream.call is not None:  # the consumer left early
                stream.call.cancel()

    def workers(self) -> list[tuple[str, WorkerView]]:
        """(kind, snapshot) of every worker, for logs and tests."""
        return [(p.kind, v) for p in (self.prefill_pool, self.decode_pool) for v in p.views()]

    # --- one request --------------------------------------------------------------------------------

    async def _attempts(
        self, request_id: str, stream: _Stream, prompt_ids: list[int], params: SamplingParams,
        hints: RequestHints, span: RequestSpan,
    ) -> AsyncIterator[TokenEvent]:
        """Try decode workers until one streams; resume a stream that lost its decode worker on
        another one (see the module docstring for the failure rules)."""
        tried: list[str] = []
        refusals: list[grpc.aio.AioRpcError] = []
        sent = SentSoFar(prompt_ids, params, self._migration_limit)
        while True:
            decode = self.decode_pool.choose(exclude=tried)
            if decode is None and not sent.token_ids:
                raise _refused(refusals) if refusals else BackendUnavailable("no healthy decode worker")
            prompt, attempt_params = sent.attempt()
            routed = await self.prefix_router.route(prompt, hints, self.decode_pool.view(decode)) \
                if decode is not None else None
            if routed is None:
                if sent.token_ids:  # the client has tokens: too late for a refusal
                    self.prefix_router.metrics.migrations.labels(outcome="ended").inc()
                    yield _error_event(request_id, "the stream lost its decode worker and no other can take it")
                    return
                raise BackendUnavailable("no healthy prefill worker")
            prefill = routed.address
            if stream.aborted:
                yield TokenEvent.ended(request_id, "abort")
                return
            local = self.local_prefill.choose(decode, len(prompt), self.prefix_router.least_queued_tokens(),
                                              routed.local_hit_tokens)
            request = decode_pb.GenerateRequest(
                transfer=common_pb.TransferId(request_id=request_id, generation=next(self._generations)),
                prompt_ids=prompt, sampling=sampling_to_proto(attempt_params), prefill_target=prefill,
                cache_salt=hints.cache_salt or "", prefill_locally=local is not None,
            )
            span.attempt(decode=decode, prefill=prefill if local is None else f"local ({decode})")
            stream.call = decode_grpc.DecodeStub(self._channels[decode]).Generate(request, metadata=span.metadata())
            outcome = _Outcome()
            hold = _PrefillHold(routed, decode, local)
            async with aclosing(self._relay(request_id, stream, hold, outcome)) as events:
                async for event in events:
                    yield sent.seen(event)
            stream.call = None
            if outcome.refusal is None and outcome.lost is None:
                return  # it ended with a final event
            path_failed = outcome.refusal is not None and outcome.refusal.code() == grpc.StatusCode.ABORTED
            if not path_failed:
                tried.append(decode)
            if sent.token_ids or outcome.lost is not None:  # the stream started: resume it, if allowed
                why = outcome.lost or f"{outcome.refusal.code().name}: {outcome.refusal.details()}"
                if not sent.may_resume():
                    self.prefix_router.metrics.migrations.labels(outcome="ended").inc()
                    yield _error_event(request_id, why)
                    return
                sent.resume()
                self.prefix_router.metrics.migrations.labels(outcome="resumed").inc()
                if path_failed:  # its prefill worker is coming back: give it a moment
                    await asyncio.sleep(self._poll_interval_s)
                log.warning("request %s: %s; resuming after %d tokens (migration %d of %d)",
                            request_id, why, len(sent.token_ids), sent.migrations, self._migration_limit)
                continue
            assert outcome.refusal is not None
            if path_failed:  # not this decode worker's fault: try again in a moment
                raise WorkerUnreachable(f"decode worker {decode} could not get the prompt prefilled by "
                                        f"{prefill}: {outcome.refusal.details()}")
            refusals.append(outcome.refusal)
            if len(tried) >= self._max_attempts:
                raise _refused(refusals)

    async def _relay(
        self, request_id: str, stream: _Stream, hold: _PrefillHold, outcome: _Outcome,
    ) -> AsyncIterator[TokenEvent]:
        """Events of one attempt, ending with a final event; or, with ``outcome`` saying why,
        nothing more: the call failed retryably before its first event (``refusal``), or the
        stream broke after it (``lost``: the worker died, or an error event came after tokens)."""
        decode = hold.decode
        self.decode_pool.acquire(decode)
        self._hold_prefill(hold)  # its prefill is busy until decode's first event
        holds_prefill, got_event = True, False
        try:
            while True:
                msg = await stream.call.read()
                if holds_prefill:
                    self._release_prefill(hold, msg if msg is not grpc.aio.EOF else None)
                    holds_prefill = False
                if msg is grpc.aio.EOF:
                    outcome.lost = f"decode worker {decode} ended the stream early"
                    return
                event = event_from_proto(request_id, msg)
                if event.finish_reason == "error":
                    self._recheck_prefill(hold)
                    if got_event:  # after tokens: the stream may go on elsewhere
                        outcome.lost = f"decode worker {decode}: {event.error}"
                        return
                got_event = True
                yield event
                if event.finished:
                    return
        except grpc.aio.AioRpcError as e:
            if stream.aborted and e.code() == grpc.StatusCode.CANCELLED:
                yield TokenEvent.ended(request_id, "abort")
                return
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # the worker is gone or unreachable
                self._suspect(self.decode_pool, decode, f"{e.code().name}: {e.details()}")
            elif e.code() == grpc.StatusCode.ABORTED:  # its prefill worker failed: ask that one now
                self._recheck_prefill(hold)
            if not got_event and e.code() in _RETRYABLE:
                outcome.refusal = e
            elif got_event:
                outcome.lost = f"decode worker {decode} failed: {e.code().name}: {e.details()}"
            else:
                yield _error_event(request_id, f"decode worker {decode} failed: {e.code().name}: {e.details()}")
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from read() after call.cancel(); a cancellation of
            # this task itself (cancelling() > 0) must propagate.
            task = asyncio.current_task()
            if stream.aborted and task is not None and task.cancelling() == 0:
                yield TokenEvent.ended(request_id, "abort")
                return
            raise
        finally:
            self.decode_pool.release(decode)
            if holds_prefill:
                self._release_prefill(hold, None)

    def _hold_prefill(self, hold: _PrefillHold) -> None:
        if hold.local is None:
            self.prefix_router.acquire(hold.routed)
            return
        self.local_prefill.acquire(hold.decode, hold.routed.local_compute_tokens)
        self.prefix_router.metrics.local_prefills.labels(reason=hold.local).inc()

    def _recheck_prefill(self, hold: _PrefillHold) -> None:
        """Ask the attempt's prefill worker's health now; a local prefill used none."""
        if hold.local is None:
            self._recheck(self.prefill_pool, hold.routed.address)

    def _release_prefill(self, hold: _PrefillHold, first_event: object | None) -> None:
        if hold.local is None:
            self.prefix_router.release(hold.routed, first_event)
            return
        self.local_prefill.release(hold.decode, hold.routed.local_compute_tokens)
        self.prefix_router.served_locally(hold.routed, first_event)

    # --- health -----------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _suspect(self, pool: WorkerPool, address: str, reason: str) -> None:
        """Stop choosing ``address`` now and ask its Health at once (it may be back already)."""
        if pool.mark_failed(address, reason):
            log.warning("%s worker %s marked unhealthy: %s", pool.kind, address, reason)
        self._recheck(pool, address)

    def _recheck(self, pool: WorkerPool, address: str) -> None:
        if not self._closed:
            self._spawn(self._poll(pool, address))

    async def _poll_forever(self) -> None:
        while True:
            polls = [self._poll(p, a) for p in (self.decode_pool, self.prefill_pool) for a in p.addresses]
            try:
                await asyncio.gather(*polls, self._poll_kvstore())
            except Exception:  # a bug: keep polling, or every worker would look healthy forever
                log.exception("health poll failed")
            await asyncio.sleep(self._poll_interval_s)

    async def _poll(self, pool: WorkerPool, address: str) -> None:
        epoch = pool.epoch(address)
        stub_type = decode_grpc.DecodeStub if pool is self.decode_pool else prefill_grpc.PrefillStub
        request = decode_pb.HealthRequest() if pool is self.decode_pool else prefill_pb.HealthRequest()
        report, error, slow = None, None, False
        try:
            reply = await stub_type(self._channels[address]).Health(request, timeout=self._health_timeout_s)
            report = HealthReport(reply.ready, reply.worker_id, reply.running, reply.waiting, reply.free_blocks,
                                  reply.cache_root, reply.block_size)
        except grpc.aio.AioRpcError as e:
            error, slow = f"health: {e.code().name}: {e.details()}", e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if pool.report(address, report, epoch, error, slow):
            if pool.is_healthy(address):
                log.info("%s worker %s is healthy", pool.kind, address)
            else:
                log.warning("%s worker %s is unhealthy: %s", pool.kind, address, error or "not ready")

    async def _poll_kvstore(self) -> None:
        if self.kvstore_address is None:
            return
        stub = kvstore_grpc.KVStoreStub(self._channels[self.kvstore_address])
        try:
            reply = await stub.Health(kvstore_pb.HealthRequest(), timeout=self._health_timeout_s)
            up = reply.index_up
        except grpc.aio.AioRpcError:
            up = False
        if up != self.kvstore_up:
            log.log(logging.INFO if up else logging.WARNING, "kvstore %s is %s",
                    self.kvstore_address, "up" if up else "down")
        self.kvstore_up = up
