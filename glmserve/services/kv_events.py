"""KVEventPublisher: ships a worker's device-tier block events to the kvstore index, off the step.

It is a ``BlockListener`` on the engine's ``BlockPool``: ``block_stored`` / ``block_removed`` only
append to a deque (O(1), no lock, no I/O), so an engine step never waits for the network. A daemon
thread wakes every ``flush_interval_s`` and publishes what accumulated as one ``PublishEvents``
batch (consecutive events of the same kind coalesced into one ``BlockEvent``).

A kvstore outage must not break serving, and must not leave the index wrong afterwards:

- The publisher keeps a mirror of the hashes this worker holds (stored adds, removed drops), so
  what it knows is bounded by the pool size however long the outage lasts.
- A failed publish marks the index out of sync; the next flush that reaches the kvstore first drops
  everything indexed for this worker (``RemoveWorker``) and then stores the whole mirror. The same
  resync runs on the first flush after start, so a restarted worker with the same id never leaves
  stale entries behind.
- An index that lost its entries while no publish failed (the kvstore restarted between two
  flushes, its Redis restarted) is seen by its epoch: every ``epoch_check_s`` the publisher asks
  Health, and a new ``index_epoch`` triggers the same resync. So the index is whole again within
  about a second of any restart, whoever restarted.
- ``close`` publishes what is pending, then removes the worker from the index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from glmserve.kv.block_index import Tier
from glmserve.services.kvstore.client import BlockEvent, EventKind, KVStoreError, KVStoreHealth

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """What the publisher needs of the kvstore (``KVStoreClient`` is one)."""

    def publish(self, events: Sequence[BlockEvent]) -> int: ...

    def remove_worker(self, worker: str) -> int: ...

    def health(self) -> KVStoreHealth: ...


class KVEventPublisher:
    """See the module docstring. ``start()`` runs the flusher thread; ``flush()`` is one round."""

    def __init__(self, worker_id: str, sink: EventSink, *, flush_interval_s: float = 0.05,
                 max_hashes_per_event: int = 4096, epoch_check_s: float = 1.0) -> None:
        if not worker_id:
            raise ValueError("worker_id: must not be empty")
        if flush_interval_s <= 0 or max_hashes_per_event < 1 or epoch_check_s <= 0:
            raise ValueError("flush_interval_s, epoch_check_s: must be > 0; max_hashes_per_event: >= 1")
        self.worker_id, self._sink = worker_id, sink
        self._interval, self._max_hashes = flush_interval_s, max_hashes_per_event
        self._epoch_check_s, self._next_check = epoch_check_s, 0.0
        self._epoch: str | None = None  # the index epoch the mirror was last synced to
        self.resyncs = 0
        self._pending: deque[tuple[EventKind, bytes]] = deque()
        self._held: dict[bytes, None] = {}  # the mirror, in store order (chain order per request)
        self._in_sync = False  # False: the index may differ from the mirror (start, outage)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flush_lock = threading.Lock()  # flush() from a test or close() vs the thread
        self.published_events = 0
        self.failures = 0  # flushes that failed after the kvstore was first reached
        self._reached = False

    # -- BlockListener (engine thread) ------------------------------------------------------------

    def block_stored(self, block_hash: bytes) -> None:
        self._pending.append(("stored", block_hash))

    def block_removed(self, block_hash: bytes) -> None:
        self._pending.append(("removed", block_hash))

    # -- flushing ---------------------------------------------------------------------------------

    @property
    def in_sync(self) -> bool:
        """True when the last flush reached the kvstore (the index matches the mirror)."""
        return self._in_sync

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.worker_id}", daemon=True)
        self._thread.start()

    def flush(self) -> bool:
        """Publish what is pending (or resync the whole mirror); True when the kvstore took it."""
        with self._flush_lock:
            batch = self._take_pending()
            try:
                epoch = self._check_epoch()
                if not self._in_sync:
                    self._resync()
                    self._epoch, self.resyncs = epoch, self.resyncs + 1
                elif batch:
                    self._send(_coalesce(self.worker_id, batch, self._max_hashes))
            except KVStoreError as e:
                if self._reached:  # before the first success the kvstore is starting, not failing
                    self.failures += 1
                if self._in_sync and self._reached:
                    log.warning("kvstore unreachable, block events held for a resync: %s", e)
                self._in_sync = False
                return False
            self._reached = True
            if not self._in_sync:
                log.info("block index resynced for worker %s (%d blocks)", self.worker_id, len(self._held))
            self._in_sync = True
            return True

    def _check_epoch(self) -> str | None:
        """Ask Health when a check is due (always before a resync); a new index epoch means the
        index lost entries: out of sync. Returns the epoch seen (None: not asked now)."""
        now = time.monotonic()
        if self._in_sync and now < self._next_check:
            return self._epoch
        self._next_check = now + self._epoch_check_s
        epoch = self._sink.health().index_epoch
        if self._in_sync and epoch != self._epoch:
            log.info("block index epoch changed (kvstore or its index restarted): resyncing worker %s",
                     self.worker_id)
            self._in_sync = False
        return epoch

    def close(self) -> None:
        """Stop the thread, publish what is pending, and drop this worker from the index."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.flush():
            try:
                self._sink.remove_worker(self.worker_id)
            except KVStoreError as e:
                log.warning("could not remove worker %s from the block index: %s", self.worker_id, e)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except Exception:  # a bug: keep the thread alive, serving goes on regardless
                log.exception("block event flush failed")

    def _take_pending(self) -> list[tuple[EventKind, bytes]]:
        """Pop what the engine appended and apply it to the mirror."""
        batch: list[tuple[EventKind, bytes]] = []
        while self._pending:  # popleft is atomic: the engine thread may append meanwhile
            kind, h = self._pending.popleft()
            if kind == "stored":
                self._held[h] = None
            else:
                self._held.pop(h, None)
            batch.append((kind, h))
        return batch

    def _resync(self) -> None:
        self._sink.remove_worker(self.worker_id)
        batch: list[tuple[EventKind, bytes]] = [("stored", h) for h in self._held]
        self._send(_coalesce(self.worker_id, batch, self._max_hashes))

    def _send(self, events: list[BlockEvent]) -> None:
        if events:
            self._sink.publish(events)
            self.published_events += len(events)


class PublisherCollector(Collector):
    """The publisher's state on the worker's ``/metrics``: ``glmserve_kv_events_published_total``,
    ``glmserve_kv_events_publish_failures_total``, ``glmserve_kv_index_resyncs_total`` (the whole
    mirror published again: at start, after an outage, after the index lost entries) and
    ``glmserve_kv_index_in_sync`` (0 during a kvstore outage, until the resync)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self._p = publisher

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield CounterMetricFamily("glmserve_kv_events_published", "Block events sent to the kvstore index.",
                                  value=self._p.published_events)
        yield CounterMetricFamily("glmserve_kv_events_publish_failures",
                                  "Flushes that could not reach the kvstore.", value=self._p.failures)
        yield CounterMetricFamily("glmserve_kv_index_resyncs",
                                  "Times this worker published all its blocks again.", value=self._p.resyncs)
        yield GaugeMetricFamily("glmserve_kv_index_in_sync",
                                "1: the kvstore index holds this worker's blocks; 0: resync pending.",
                                value=1.0 if self._p.in_sync else 0.0)


def _coalesce(worker: str, batch: list[tuple[EventKind, bytes]], max_hashes: int) -> list[BlockEvent]:
    """Runs of the same kind become one event each (order kept), at most ``max_hashes`` hashes."""
    events: list[BlockEvent] = []
    run: list[bytes] = []
    kind: EventKind | None = None
    for k, h in batch:
        if run and (k != kind or len(run) >= max_hashes):
            events.append(BlockEvent(kind, worker, Tier.DEVICE, run))  # type: ignore[arg-type]
            run = []
        kind = k
        run.append(h)
    if run:
        events.append(BlockEvent(kind, worker, Tier.DEVICE, run))  # type: ignore[arg-type]
    return events
