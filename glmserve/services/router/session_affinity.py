"""SessionAffinity: which prefill worker holds an agent session's KV, for a TTL after each turn.

An agent's next turn resends the previous prompt plus the answer and a tool result; it is cheapest
on the worker that computed the previous turn. The table remembers (session id -> worker) and
forgets an entry ``ttl_s`` after the session's last turn (tool calls can take minutes, but a
session that went quiet should not pin a worker forever). Bounded: at ``max_sessions`` the entry
closest to expiry is dropped. Pure logic; the clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class SessionAffinity:
    def __init__(self, ttl_s: float = 600.0, max_sessions: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_sessions < 1:
            raise ValueError("ttl_s: must be > 0; max_sessions: >= 1")
        self.ttl_s, self.max_sessions, self._clock = ttl_s, max_sessions, clock
        # Ordered by last use, so the oldest entry is also the one closest to expiry.
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> str | None:
        """The worker of ``session_id``, or None when unknown or expired."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        worker, expires = entry
        if self._clock() >= expires:
            del self._entries[session_id]
            return None
        return worker

    def record(self, session_id: str, worker: str) -> None:
        """``session_id``'s latest turn ran on ``worker``: keep it there for another TTL."""
        self._entries.pop(session_id, None)
        self._entries[session_id] = (worker, self._clock() + self.ttl_s)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)
        self._expire_some()

    def forget_worker(self, worker: str) -> None:
        """Drop every session on ``worker`` (it left the cluster)."""
        for sid in [s for s, (w, _) in self._entries.items() if w == worker]:
            del self._entries[sid]

    def _expire_some(self) -> None:
        # Entries are in last-use order: expired ones are at the front; stop at the first live one.
        now = self._clock()
        while self._entries:
            sid, (_, expires) = next(iter(self._entries.items()))
            if expires > now:
                break
            del self._entries[sid]
