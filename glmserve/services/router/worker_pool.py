"""WorkerPool: the router's view of one kind of worker (prefill or decode): health, load, choice.

Pure logic (no I/O, no asyncio): the gRPC backend feeds it Health answers and failures and asks it
whom to send a request to.

- A worker is *healthy* when its latest Health answer said ``ready`` and nothing failed since. It
  starts unhealthy (no answer yet). ``mark_failed`` (a stream broke, a call was refused) makes it
  unhealthy at once; only a Health answer to a poll *started after* the failure makes it healthy
  again. Polls carry the worker's ``epoch`` from when they started, and ``mark_failed`` moves the
  epoch on, so an answer that was already in flight when the worker died is ignored. A poll that
  could not connect makes the worker unhealthy at once; one that only timed out (``slow``: a busy
  worker answers late) does so after ``max_slow_polls`` in a row.
- *Load* is ``max(running + waiting reported by Health, requests this router has in flight there)``:
  the report covers other routers, the local count covers requests sent since the last poll.
- ``choose`` takes the healthy worker with (blocks left first, least load, most free blocks) and
  breaks exact ties round-robin, so a burst of requests between two polls spreads out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class HealthReport:
    """One Health answer (the fields prefill and decode share)."""

    ready: bool
    worker_id: str = ""
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    cache_root: bytes = b""  # root of its prefix-cache hash chain (empty: caching off)
    block_size: int = 0


@dataclass(frozen=True)
class WorkerView:
    """A read-only snapshot of one worker, for logs, `/ready` detail and tests."""

    address: str
    healthy: bool
    load: int
    inflight: int
    free_blocks: int
    worker_id: str
    last_error: str | None
    cache_root: bytes = b""
    block_size: int = 0


@dataclass
class _Worker:
    address: str
    healthy: bool = False
    report: HealthReport | None = None
    inflight: int = 0
    epoch: int = 0
    slow_polls: int = 0  # timed-out polls in a row
    last_error: str | None = "no health answer yet"
    index: int = field(default=0)

    @property
    def load(self) -> int:
        reported = self.report.running + self.report.waiting if self.report is not None else 0
        return max(reported, self.inflight)

    @property
    def free_blocks(self) -> int:
        return self.report.free_blocks if self.report is not None else 0


def check_address(address: str) -> str:
    """``address`` if it is ``host:port`` with a port in 1..65535, else ``ValueError``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address: expected host:port, got {address!r}")
    return address


class WorkerPool:
    """Health, load and choice for the workers of one ``kind`` (see the module docstring)."""

    def __init__(self, kind: str, addresses: Sequence[str], max_slow_polls: int = 3):
        if max_slow_polls < 1:
            raise ValueError(f"max_slow_polls: must be >= 1, got {max_slow_polls}")
        if not addresses:
            raise ValueError(f"{kind}: at least one worker address is needed")
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"{kind}: duplicate worker addresses in {list(addresses)}")
        self.kind, self.max_slow_polls = kind, max_slow_polls
        self._workers = {a: _Worker(check_address(a), index=i) for i, a in enumerate(addresses)}
        self._next = 0  # round-robin cursor: index of the worker preferred on the next tie

    @property
    def addresses(self) -> list[str]:
        return list(self._workers)

    def epoch(self, address: str) -> int:
        """Pass this to `report` for a poll started now."""
        return self._workers[address].epoch

    def report(self, address: str, report: HealthReport | None, epoch: int, error: str | None = None,
               slow: bool = False) -> bool:
        """Apply a Health poll's outcome (``report`` None: the poll failed with ``error``; ``slow``:
        it only timed out). Ignored when the worker failed after the poll started (``epoch`` is
        stale). Returns True when the worker's healthy state changed.
        """
        w = self._workers[address]
        if epoch != w.epoch:
            return False
        w.slow_polls = w.slow_polls + 1 if report is None and slow else 0
        if 0 < w.slow_polls < self.max_slow_polls:
            return False  # maybe just busy: keep the last verdict for now
        was = w.healthy
        w.report = report if report is not None else w.report
        w.healthy = report is not None and report.ready
        if report is None:
            w.last_error = error or "health check failed"
        else:
            w.last_error = None if report.ready else "worker reports not ready"
        return was != w.healthy

    def mark_failed(self, address: str, reason: str) -> bool:
        """The worker failed in a request: stop choosing it until a newer Health answer says ready.
        Returns True when it was healthy until now."""
        w = self._workers[address]
        was = w.healthy
        w.healthy, w.last_error, w.epoch = False, reason, w.epoch + 1
        return was

    def is_healthy(self, address: str) -> bool:
        return self._workers[address].healthy

    def any_healthy(self) -> bool:
        return any(w.healthy for w in self._workers.values())

    def choose(self, exclude: Iterable[str] = ()) -> str | None:
        """The healthy worker to use now (None when there is none outside ``exclude``)."""
        skip = set(exclude)
        candidates = [w for w in self._workers.values() if w.healthy and w.address not in skip]
        if not candidates:
            return None
        n = len(self._workers)
        best = min(
            candidates,
            key=lambda w: (w.free_blocks == 0, w.load, -w.free_blocks, (w.index - self._next) % n),
        )
        self._next = (best.index + 1) % n
        return best.address

    def acquire(self, address: str) -> None:
        """A request of this router now runs on ``address`` (pair with `release`)."""
        self._workers[address].inflight += 1

    def release(self, address: str) -> None:
        w = self._workers[address]
        w.inflight = max(0, w.inflight - 1)
        if w.report is not None and w.report.running > 0:
            # The last poll probably counted the request that just ended; without this a stale
            # report keeps an idle worker looking busy until the next poll.
            w.report = replace(w.report, running=w.report.running - 1)

    def views(self) -> list[WorkerView]:
        return [self._view(w) for w in self._workers.values()]

    def view(self, address: str) -> WorkerView:
        return self._view(self._workers[address])

    @staticmethod
    def _view(w: _Worker) -> WorkerView:
        r = w.report
        return WorkerView(w.address, w.healthy, w.load, w.inflight, w.free_blocks, r.worker_id if r else "",
                          w.last_error, r.cache_root if r else b"", r.block_size if r else 0)
