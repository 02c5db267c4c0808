"""Supervisor: keeps a set of child services running; restarts the one that dies, alone.

A child that exits while the supervisor is not stopping is restarted from its `ChildSpec` (same
command line, same ports) after a backoff that doubles with every restart in a row
(``initial_backoff_s`` up to ``max_backoff_s``); the others keep serving meanwhile. A child that
stayed ready for ``stable_after_s`` starts its count over. One more death after ``max_restarts``
restarts in a row raises `GaveUp`: a crash loop (a bad flag, a model that fails to load, a port
taken by someone else) ends the launcher loudly instead of spinning. Nothing here knows what a
child is: issue-15's LayerSplit stages are supervised like any worker.

``watch()`` does one round (reap, restart what is due, report children that are back) and is called
by the launcher's loop; nothing runs on a thread of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from glmserve.commands.child import ChildProcess, ChildSpec, die_with_parent_hook, exit_description
from glmserve.services.metrics_exposition import RESTARTS_ENV


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_restarts: int = 5  # restarts in a row without a stable run; one more death gives up
    stable_after_s: float = 60.0  # ready this long: the restart count starts over

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("initial_backoff_s: must be > 0 and <= max_backoff_s")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        if self.stable_after_s <= 0:
            raise ValueError(f"stable_after_s: must be > 0, got {self.stable_after_s}")

    def backoff_s(self, restart: int) -> float:
        """Delay before the ``restart``-th restart in a row (1-based)."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** (restart - 1))


class GaveUp(Exception):
    """A child kept dying; the message says which and how."""


@dataclass
class _Slot:
    spec: ChildSpec
    proc: ChildProcess | None = None
    in_a_row: int = 0  # restarts since the last stable run
    restarts: int = 0  # in all
    restart_at: float | None = None  # a restart is due then (proc is None meanwhile)
    ready_since: float | None = None


class Supervisor:
    def __init__(self, policy: RestartPolicy, env: dict[str, str], say: Callable[[str, bool], None],
                 out_lock: threading.Lock, clock: Callable[[], float] = time.monotonic):
        """``say(message, is_error)`` reports restarts; ``out_lock`` is held while a child's output
        line is written (``say`` may take it too)."""
        self.policy, self._env, self._say, self._clock = policy, env, say, clock
        self._slots: dict[str, _Slot] = {}
        self._out_lock = out_lock
        self._preexec = die_with_parent_hook()
        self._stopping = False

    # -- children ------------------------------------------------------------------------------------

    def start(self, spec: ChildSpec) -> ChildProcess:
        if spec.name in self._slots:
            raise ValueError(f"name: {spec.name!r} is already supervised")
        slot = self._slots[spec.name] = _Slot(spec)
        return self._launch(slot)

    def _launch(self, slot: _Slot) -> ChildProcess:
        # the child's glmserve_process_restarts_total starts from this count, so the series goes on
        env = {**self._env, RESTARTS_ENV: str(slot.restarts)}
        slot.proc, slot.restart_at, slot.ready_since = ChildProcess(
            slot.spec, env, self._out_lock, self._preexec), None, None
        return slot.proc

    def process(self, name: str) -> ChildProcess | None:
        """The current process of ``name`` (None while a restart is pending)."""
        return self._slots[name].proc

    def specs(self) -> list[ChildSpec]:
        return [s.spec for s in self._slots.values()]

    def restarts(self) -> dict[str, int]:
        return {name: s.restarts for name, s in self._slots.items()}

    def is_ready(self, name: str) -> bool:
        return self._slots[name].ready_since is not None

    # -- one round -----------------------------------------------------------------------------------

    def watch(self) -> None:
        """Reap children that died (schedule their restart, or raise `GaveUp`), start the restarts
        that are due, and note children that became ready."""
        if self._stopping:
            return
        now = self._clock()
        for slot in self._slots.values():
            if slot.proc is not None:
                self._check(slot, now)
            elif slot.restart_at is not None and now >= slot.restart_at:
                slot.restarts += 1
                self._launch(slot)
                self._say(f"{slot.spec.name} restarted (pid {slot.proc.pid}, restart {slot.restarts})", False)

    def _check(self, slot: _Slot, now: float) -> None:
        assert slot.proc is not None
        status = slot.proc.exit_status()
        if status is not None:
            self._died(slot, exit_description(status), now)
            return
        if slot.ready_since is None and slot.proc.is_ready():
            slot.ready_since = now
            if slot.restarts:
                self._say(f"{slot.spec.name} is back at {slot.spec.address}", False)
        elif slot.ready_since is not None and now - slot.ready_since >= self.policy.stable_after_s:
            slot.in_a_row = 0

    def _died(self, slot: _Slot, how: str, now: float) -> None:
        slot.proc = None
        if slot.in_a_row >= self.policy.max_restarts:
            raise GaveUp(f"{slot.spec.name} {how} after {slot.in_a_row} restarts in a row; giving up")
        slot.in_a_row += 1
        delay = self.policy.backoff_s(slot.in_a_row)
        slot.restart_at = now + delay
        self._say(f"{slot.spec.name} {how}; restarting it in {delay:.1f} s "
                  f"({slot.in_a_row} of at most {self.policy.max_restarts} in a row)", True)

    def wait_ready(self, names: Iterable[str], deadline: float, stop: threading.Event,
                   timeout_s: float) -> None:
        """Watch until every child in ``names`` is ready. `GaveUp` on a crash loop, ``TimeoutError``
        naming the laggards at ``deadline``, ``InterruptedError`` when ``stop`` is set."""
        pending = list(names)
        while True:
            self.watch()
            pending = [n for n in pending if not self.is_ready(n)]
            if not pending:
                return
            if stop.is_set():
                raise InterruptedError("stopped before every process was ready")
            if self._clock() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {', '.join(pending)} "
                                   "to be ready (see their output above)")
            stop.wait(0.1)

    # -- stop ----------------------------------------------------------------------------------------

    def stop_all(self, grace_s: float) -> None:
        """No more restarts; SIGTERM each stop rank in turn (lowest first) and wait for it up to
        ``grace_s``; SIGKILL what outlives that."""
        self._stopping = True
        for rank in sorted({s.spec.stop_rank for s in self._slots.values()}):
            group = [s.proc for s in self._slots.values() if s.spec.stop_rank == rank and s.proc is not None]
            for proc in group:
                proc.terminate()
            deadline = time.monotonic() + grace_s
            for proc in group:
                if not proc.wait(deadline):
                    self._say(f"{proc.spec.name} did not stop in {grace_s:.0f} s; killing it", True)
                    proc.kill()
                    proc.wait(time.monotonic() + 5)
