"""RequestRun: one request's run through the admission queue and the backend, transport-free. Every
API the router serves (chat, completions, and the ones built on them) runs its tokens through this.

`open()` does everything that may refuse the request, before any byte of its answer exists: a
place in the admission queue (429 queue full / wait exceeded / tenant cap, 503 draining; the
`Retry-After` header says when to come back), then the backend up to the request's first event
(503 with no healthy worker; a backend whose workers are all full (`BackendFull`) is waited for
with the queue's ticket, and tried again, until the queue wait is spent: 429; one whose workers
could not take it just now (`WorkerUnreachable`: a restart's reconnect) is tried again every
moment until then: 503, never a 500). Then `events()`
streams the backend's `TokenEvent`s and keeps the router's metrics; `close()` (idempotent) gives
the slot back and aborts the request in the backend unless it finished. The client going away
(``RequestContext.disconnected`` returns) aborts the request at once, queued or running, even while
no token is due (a long prefill). A backend failure becomes an `APIError` (500, or 503 when the
server aborted the request); client messages never carry the workers' addresses (the log has them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.services.router.admission import AdmissionQueue, ClientGone, Rejected, Ticket
from glmserve.services.router.backend import (
    BackendFull,
    BackendUnavailable,
    GenerationBackend,
    RequestHints,
    WorkerUnreachable,
)
from glmserve.services.router.errors import (
    APIError,
    internal_error,
    refused,
    refused_request,
    service_unavailable,
    without_addresses,
)
from glmserve.services.router.metrics import RequestTracker, RouterMetrics
from glmserve.services.router.token_logprobs import TokenLogprob, token_logprobs
from glmserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestContext:
    """What the transport knows about one request.

    - ``arrival``: its `time.monotonic()` arrival; ``endpoint``: the API path (for metrics);
    - ``hints``: session and tenant cache salt (`RequestHints`);
    - ``disconnected``: returns once the client has gone away (never, for a client that stays);
    - ``client_request_id``: the ``x-request-id`` the answer carries (in log lines);
    - ``tenant``: whose share of the admission queue it takes ("" : anonymous, no per-tenant cap);
      ``priority``: lower runs first.
    """

    arrival: float
    endpoint: str
    hints: RequestHints
    disconnected: Callable[[], Awaitable[None]]
    client_request_id: str = ""
    tenant: str = ""
    priority: int = 0


@dataclass
class Output:
    """What a request's events added up to so far."""

    text: str = ""
    num_generated: int = 0  # ids the backend generated (usage counts these)
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # None: not finished (or the client went away)
    stop_reason: int | str | None = None

    def add(self, event: TokenEvent, logprobs: list[TokenLogprob]) -> None:
        self.text += event.text
        self.num_generated += len(event.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        self.logprobs += logprobs
        self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason


class RequestRun:
    """One request's run: `open()`, then iterate `events()` (or `deltas()`) once; `close()`."""

    def __init__(self, backend: GenerationBackend, metrics: RouterMetrics, tokenizer: Tokenizer,
                 request_id: str, prompt_ids: list[int], params: SamplingParams, ctx: RequestContext,
                 admission: AdmissionQueue, on_close: Callable[[RequestRun], None] | None = None) -> None:
        self.backend, self.metrics, self.tokenizer = backend, metrics, tokenizer
        self.request_id, self.prompt_ids, self.params, self.ctx = request_id, prompt_ids, params, ctx
        self.admission, self._on_close = admission, on_close
        self.output = Output()
        self.disconnected = False
        self._gone = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._ticket: Ticket | None = None
        self._stream: AsyncIterator[TokenEvent] | None = None
        self._first: TokenEvent | None = None
        self._tracker: RequestTracker | None = None
        self._finished = self._closed = False

    async def _watch(self) -> None:
        try:
            await self.ctx.disconnected()
        except Exception:  # a broken channel means the client is gone as well
            pass
        self.disconnected = True
        self._gone.set()
        await self.backend.abort(self.request_id)

    # --- opening: every refusal happens here ----------------------------------------------------------

    async def open(self) -> bool:
        """Admit the request and start it up to its first event. False: the client left first
        (answered 499, counted). Raises `APIError` (429 / 503 with ``Retry-After``, 500), counted
        by whoever answers it; the run is closed then."""
        self._watcher = asyncio.create_task(self._watch())
        try:
            self._ticket = await self.admission.admit(self.ctx.tenant, self.ctx.priority, self._gone)
            first = await self._first_event()
        except ClientGone:
            await self.close()
            self.metrics.count(499, self.ctx.endpoint)
            return False
        except Rejected as e:
            await self.close()
            log.warning("request %s refused (%s): %d %s", self._who, e.reason, e.status, e)
            raise refused(e.status, str(e), e.reason, e.retry_after_s) from None
        except BaseException:
            await self.close()
            raise
        # Accepted: timed and counted from here (TTFT from the arrival, queue wait included).
        self._tracker = self.metrics.track(len(self.prompt_ids), self.ctx.arrival, self.ctx.endpoint)
        self._first = first
        return True

    async def _first_event(self) -> TokenEvent:
        assert self._ticket is not None
        while True:
            stream = self.backend.generate(self.request_id, self.prompt_ids, self.params, self.ctx.hints)
            try:
                first = await anext(stream)
            except BackendFull as e:  # a state that passes: wait for a request to end, then try again
                log.info("request %s waits for a decode worker: %s", self._who, e)
                await self._ticket.wait_for_capacity(self._gone)
                continue
            except WorkerUnreachable as e:  # passes too (a restart): try again in a moment
                log.info("request %s tries again: %s", self._who, e)
                if await self._ticket.wait_to_retry(self._gone):
                    continue
                self.metrics.rejected("no_worker")
                log.warning("request %s refused (no_worker): 503 %s", self._who, e)
                raise service_unavailable() from None
            except BackendUnavailable as e:
                self.metrics.rejected("no_worker")
                log.warning("request %s refused (no_worker): 503 %s", self._who, e)
                raise service_unavailable() from None
            except StopAsyncIteration:
                raise self._failed("the backend ended the stream without an event") from None
            self._stream = stream
            if first.finish_reason == "abort" and self.disconnected:
                raise ClientGone("the client left before the first token")
            if first.finish_reason in ("error", "abort"):
                self._finished = True  # the backend ended it: nothing to abort
                raise self._ended_by_backend(first)
            return first

    @property
    def _who(self) -> str:
        """The request, as log lines name it."""
        return f"{self.request_id} (x-request-id {self.ctx.client_request_id or '-'})"

    def _failed(self, detail: str | None) -> APIError:
        log.warning("request %s failed: %s", self._who, detail)
        return internal_error(f"generation failed: {without_addresses(detail or 'unknown error')}")

    def _ended_by_backend(self, event: TokenEvent) -> APIError:
        """The answer for an event that ended the request on the server's side: 503 for an abort,
        400 for a field the backend checks (`refused_request`), else 500."""
        if event.finish_reason == "abort":
            return service_unavailable("the request was aborted by the server")
        return refused_request(event.error) or self._failed(event.error)

    # --- running ---------------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The backend's events, each added to `output`; raises `APIError` on a backend failure;
        ends quietly (with `disconnected` set) when the client went away."""
        if self._first is None and (self._closed or not await self.open()):
            return
        event, self._first = self._first, None
        status: int | None = None  # an error status; else decided in `close`
        assert self._stream is not None and self._tracker is not None
        try:
            while event is not None:
                self._tracker.on_tokens(len(event.token_ids))
                self._finished = event.finished
                if event.finished:
                    self.metrics.finished(event.finish_reason)
                if event.finish_reason in ("error", "abort"):
                    if event.finish_reason == "abort" and self.disconnected:
                        return
                    err = self._ended_by_backend(event)
                    status = err.status
                    raise err
                self.output.add(event, token_logprobs(self.tokenizer, event))
                yield event
                if event.finished:
                    return
                event = await anext(self._stream, None)
            status = 500
            raise self._failed("the backend ended the stream without a final event")
        except BackendUnavailable as e:
            status = 503
            log.warning("request %s lost its backend: %s", self._who, e)
            raise service_unavailable() from e
        finally:
            await self.close(status)

    async def close(self, status: int | None = None) -> None:
        """Give everything back (idempotent): the queue slot; the request in the backend unless it
        finished; the metrics (``status``, else 200 when finished, 499 when not)."""
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            self._on_close(self)
        if self._watcher is not None:
            self._watcher.cancel()
        with anyio.CancelScope(shield=True):  # must reach the backend even when cancelled
            if self._stream is not None:
                await self._stream.aclose()  # type: ignore[attr-defined]
            if not self._finished:
                await self.backend.abort(self.request_id)
        if self._ticket is not None:
            self._ticket.release()
        if self._tracker is not None:
            self._tracker.finish(status or (200 if self._finished and not self.disconnected else 499))

    async def end(self) -> None:
        """The server ends the request (a drain ran out of time): it is aborted in the backend, so
        its answer ends with an error (503; in a stream, an error event and ``[DONE]``)."""
        await self.backend.abort(self.request_id)

    async def run_to_end(self) -> Output:
        """Every event, for a whole (non-streamed) answer; ``finish_reason`` None: the client left."""
        async with aclosing(self.events()) as events:
            async for _ in events:
                pass
        return self.output

    async def deltas(self) -> AsyncIterator[tuple[str, list[TokenLogprob], str | None]]:
        """(text, logprobs, finish_reason) per event; the finish reason is set on the last one."""
        seen = 0
        async with aclosing(self.events()) as events:
            async for event in events:
                logprobs = self.output.logprobs[seen:]
                seen = len(self.output.logprobs)
                yield event.text, logprobs, event.finish_reason
