"""RequestRun: one accepted request's run through the backend, transport-free. Every API the router
serves (chat, completions, and the ones built on them) runs its tokens through this.

It streams the backend's `TokenEvent`s, keeps the router's metrics, and aborts the request in the
backend when the client goes away (``RequestContext.disconnected`` returns), even while no token
is due (a long prefill), or when the stream is closed any other way (cancellation, an error).
A backend failure becomes an `APIError` (500, or 503 when the server aborted the request).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.services.router.backend import BackendUnavailable, GenerationBackend, RequestHints
from glmserve.services.router.errors import internal_error, refused_request, service_unavailable
from glmserve.services.router.metrics import RouterMetrics
from glmserve.services.router.token_logprobs import TokenLogprob, token_logprobs
from glmserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestContext:
    """What the transport knows about one request.

    - ``arrival``: its `time.monotonic()` arrival; ``endpoint``: the API path (for metrics);
    - ``hints``: session and tenant cache salt (`RequestHints`);
    - ``disconnected``: returns once the client has gone away (never, for a client that stays);
    - ``client_request_id``: the ``x-request-id`` the answer carries (in log lines).
    """

    arrival: float
    endpoint: str
    hints: RequestHints
    disconnected: Callable[[], Awaitable[None]]
    client_request_id: str = ""


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
    """One request's run; iterate `events()` (or `deltas()`) once."""

    def __init__(self, backend: GenerationBackend, metrics: RouterMetrics, tokenizer: Tokenizer,
                 request_id: str, prompt_ids: list[int], params: SamplingParams, ctx: RequestContext) -> None:
        self.backend, self.metrics, self.tokenizer = backend, metrics, tokenizer
        self.request_id, self.prompt_ids, self.params, self.ctx = request_id, prompt_ids, params, ctx
        self.output = Output()
        self.disconnected = False

    async def _watch(self) -> None:
        try:
            await self.ctx.disconnected()
        except Exception:  # a broken channel means the client is gone as well
            pass
        self.disconnected = True
        await self.backend.abort(self.request_id)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The backend's events, each added to `output`; raises `APIError` on a backend failure;
        ends quietly (with `disconnected` set) when the client went away."""
        # Tracked from here, not from construction: a stream that never starts holds nothing.
        tracker = self.metrics.track(len(self.prompt_ids), self.ctx.arrival, self.ctx.endpoint)
        watcher = asyncio.create_task(self._watch())
        status: int | None = None  # an error status; else decided in `finally`
        finished = False
        try:
            stream = self.backend.generate(self.request_id, self.prompt_ids, self.params, self.ctx.hints)
            async with aclosing(stream):
                async for event in stream:
                    tracker.on_tokens(len(event.token_ids))
                    finished = event.finished
                    if finished:
                        self.metrics.finished(event.finish_reason)
                    if event.finish_reason == "error":
                        refused = refused_request(event.error)
                        status = 400 if refused is not None else 500
                        log.warning("request %s (x-request-id %s) failed: %s", self.request_id,
                                    self.ctx.client_request_id, event.error)
                        raise refused or internal_error(f"generation failed: {event.error}")
                    if event.finish_reason == "abort":
                        if not self.disconnected:
                            status = 503
                            raise service_unavailable("the request was aborted by the server")
                        return
                    self.output.add(event, token_logprobs(self.tokenizer, event))
                    yield event
        except BackendUnavailable as e:
            log.warning("request %s (x-request-id %s): %s", self.request_id, self.ctx.client_request_id, e)
            status = 503
            raise service_unavailable(str(e)) from e
        finally:
            watcher.cancel()
            if not finished:
                with anyio.CancelScope(shield=True):  # must reach the backend even when cancelled
                    await self.backend.abort(self.request_id)
            tracker.finish(status or (200 if finished and not self.disconnected else 499))

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
