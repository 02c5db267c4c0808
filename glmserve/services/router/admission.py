"""AdmissionQueue: the router's bounded queue in front of the workers; overload that says what it is.

At most ``max_running`` requests run at once; the next ones wait in the queue, ordered by priority
(lower first, as vLLM orders ``priority``), then by arrival. A request is refused, before any byte
of its answer, when:

- the queue holds ``max_queued`` requests (``queue_full``, 429), or its tenant already has
  ``max_queued_per_tenant`` there (``tenant_cap``, 429: one key cannot fill the queue; the
  anonymous tenant "", all requests of a router without API keys, has no cap of its own);
- it waited ``max_wait_s`` without starting (``queue_timeout``, 429);
- the router is draining (``draining``, 503; queued requests are refused at once, running ones
  finish).

A queued request whose client left is dropped at once (the caller sets its ``gone`` event),
freeing its place. A running request that finds every decode worker full keeps its slot and waits
(`Ticket.wait_for_capacity`) until another request ends or ``capacity_poll_s`` passed (another
router's requests may have ended), then tries again, until its first arrival's deadline: a full
worker means "wait", not "unavailable". One whose workers could not be reached just now (a
restart) tries again every ``retry_poll_s`` (`Ticket.wait_to_retry`) until that deadline. Every refusal carries ``retry_after_s`` for the
``Retry-After`` header.

Pure asyncio, no I/O; one instance per router, used on its event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from glmserve.services.router.admission_metrics import AdmissionMetrics


@dataclass(frozen=True)
class AdmissionConfig:
    max_running: int = 64  # requests running at once on this router
    max_queued: int = 256  # requests waiting to run
    max_queued_per_tenant: int = 64  # one tenant's share of the queue
    max_wait_s: float = 30.0  # longest wait in the queue (and for a full worker) before a 429
    retry_after_s: int = 1  # what Retry-After says
    capacity_poll_s: float = 0.1  # a request waiting for a full worker tries again this often
    retry_poll_s: float = 0.2  # ... and one whose workers were unreachable (a restart)

    def __post_init__(self) -> None:
        for name in ("max_running", "max_queued", "max_queued_per_tenant", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_wait_s <= 0 or self.capacity_poll_s <= 0 or self.retry_poll_s <= 0:
            raise ValueError(f"max_wait_s, capacity_poll_s, retry_poll_s: must be > 0, got {self.max_wait_s}, "
                             f"{self.capacity_poll_s}, {self.retry_poll_s}")


class Rejected(Exception):
    """The request is refused before it started; ``status`` 429 or 503, ``reason`` for metrics."""

    def __init__(self, reason: str, status: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason, self.status, self.retry_after_s = reason, status, retry_after_s


class ClientGone(Exception):
    """The client left while its request was queued; nothing was started."""


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    tenant: str = field(compare=False)
    granted: asyncio.Future[None] = field(compare=False)


class Ticket:
    """A running request's slot; `release` it (once) when the request ended."""

    def __init__(self, queue: AdmissionQueue, tenant: str, priority: int, seq: int, deadline: float) -> None:
        self._queue, self.tenant, self.priority, self._seq, self.deadline = queue, tenant, priority, seq, deadline
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._queue._release()

    async def wait_for_capacity(self, gone: asyncio.Event) -> None:
        """Every decode worker was full: wait, keeping the slot, until another request ended or
        ``capacity_poll_s`` passed, then the caller tries again. `Rejected` (``queue_timeout``)
        past the first arrival's deadline, `ClientGone` when ``gone`` is set."""
        await self._queue._await_capacity(self.deadline, gone)

    async def wait_to_retry(self, gone: asyncio.Event) -> bool:
        """The workers could not be reached: wait ``retry_poll_s``, keeping the slot; False when
        the first arrival's deadline has passed (the caller answers 503). `ClientGone` when
        ``gone`` is set, `Rejected` (``draining``) once the router drains."""
        return await self._queue._await_retry(self.deadline, gone)


class AdmissionQueue:
    def __init__(self, config: AdmissionConfig, metrics: AdmissionMetrics | None = None) -> None:
        self.config, self.metrics = config, metrics
        self._running = 0
        self._heap: list[_Waiter] = []
        self._per_tenant: dict[str, int] = {}
        self._seq = itertools.count()
        self._draining = False
        self._ended: asyncio.Event | None = None  # set when a request ends (made on first use)

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return sum(self._per_tenant.values())

    @property
    def draining(self) -> bool:
        return self._draining

    async def admit(self, tenant: str, priority: int, gone: asyncio.Event) -> Ticket:
        """A slot for a new request (at once, or after waiting in the queue). Raises `Rejected`, or
        `ClientGone` when ``gone`` is set first."""
        loop = asyncio.get_running_loop()
        seq = next(self._seq)
        deadline = loop.time() + self.config.max_wait_s
        await self._wait(tenant, priority, seq, deadline, gone)
        return Ticket(self, tenant, priority, seq, deadline)

    def drain(self) -> None:
        """Refuse everything from now on (503); the queued requests are refused at once."""
        self._draining = True
        for waiter in self._heap:
            waiter.granted.set_exception(self._refused("draining"))
        self._heap.clear()

    # -- internals -------------------------------------------------------------------------------------

    async def _wait(self, tenant: str, priority: int, seq: int, deadline: float, gone: asyncio.Event) -> None:
        if self._draining:
            raise self._refused("draining")
        if self._running < self.config.max_running and not self._heap:
            self._running += 1
            return
        if self.queued >= self.config.max_queued:
            raise self._refused("queue_full")
        if tenant and self._per_tenant.get(tenant, 0) >= self.config.max_queued_per_tenant:
            raise self._refused("tenant_cap")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, seq, tenant, loop.create_future())
        heapq.heappush(self._heap, waiter)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        started = loop.time()
        self._gauge()
        left = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({waiter.granted, left}, timeout=max(0.0, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            self._leave(waiter)
        if self.metrics is not None:
            self.metrics.wait.observe(loop.time() - started)
        if waiter.granted.done():
            waiter.granted.result()  # raises a draining refusal
            return  # _grant counted us as running
        if gone.is_set():
            self._count("gone")
            raise ClientGone("the client left while its request was queued")
        raise self._refused("queue_timeout")

    def _leave(self, waiter: _Waiter) -> None:
        """Out of the queue (granted, refused, timed out or gone). The heap holds only waiters still
        waiting, so a free slot with an empty heap means "run now"."""
        if waiter in self._heap:  # timed out or gone; granted and drained ones were taken out already
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
        if waiter.tenant in self._per_tenant:
            self._per_tenant[waiter.tenant] -= 1
            if self._per_tenant[waiter.tenant] == 0:
                del self._per_tenant[waiter.tenant]
        self._gauge()

    async def _await_capacity(self, deadline: float, gone: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        if self._draining:
            raise self._refused("draining")
        if loop.time() >= deadline:
            raise self._refused("queue_timeout")
        if self._ended is None or self._ended.is_set():
            self._ended = asyncio.Event()
        waits = [asyncio.ensure_future(e.wait()) for e in (self._ended, gone)]
        try:
            await asyncio.wait(waits, timeout=min(self.config.capacity_poll_s, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if gone.is_set():
            self._count("gone")
            raise ClientGone("the client left while its request waited for a decode worker")

    async def _await_retry(self, deadline: float, gone: asyncio.Event) -> bool:
        loop = asyncio.get_running_loop()
        if self._draining:
            raise self._refused("draining")
        left = deadline - loop.time()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(gone.wait(), timeout=min(self.config.retry_poll_s, left))
        except TimeoutError:
            return True
        self._count("gone")
        raise ClientGone("the client left while its request waited for a worker to come back")

    def _release(self) -> None:
        if self._ended is not None:
            self._ended.set()
        self._running -= 1
        while self._heap and self._running < self.config.max_running:
            self._running += 1
            heapq.heappop(self._heap).granted.set_result(None)

    def _refusal(self, reason: str) -> Rejected:
        messages = {
            "queue_full": (429, "the server is overloaded: the request queue is full"),
            "tenant_cap": (429, "too many queued requests for this API key"),
            "queue_timeout": (429, f"the request waited {self.config.max_wait_s:g} s in the queue without starting"),
            "draining": (503, "the server is shutting down"),
        }
        status, message = messages[reason]
        return Rejected(reason, status, message, self.config.retry_after_s)

    def _refused(self, reason: str) -> Rejected:
        self._count(reason)
        return self._refusal(reason)

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queued.set(self.queued)
