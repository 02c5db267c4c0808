"""PrefillHistory: what a prefill worker remembers about transfers that are no longer running.

For each request id, the latest generation that finished, failed or was aborted, and whether its
destination blocks are drained (no more bytes can land in them), kept ``ttl_s`` seconds. It answers
two questions (DESIGN invariant 3, state only moves forward):

- ``refuses(request_id, generation)``: a Prefill for a generation at or below one already ended
  is refused. This covers the race where decode's Abort overtakes its own Prefill call: the Abort
  leaves a tombstone, and the late Prefill never writes into blocks decode has already freed.
- ``abort(request_id, generation)``: the drained answer for a transfer that is not running (True
  unless that very generation ended with a write the writer could not drain).

``ttl_s`` must exceed how long a Prefill call may stay in the network (its deadline, the decode
worker's ``--prefill-timeout-s``); the default leaves a wide margin. Not thread-safe: event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_TTL_S = 600.0


@dataclass(frozen=True)
class _Ended:
    generation: int
    drained: bool
    expires: float


class PrefillHistory:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s!r}")
        self._ttl_s = ttl_s
        self._ended: OrderedDict[str, _Ended] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._ended)

    def record(self, request_id: str, generation: int, drained: bool) -> None:
        """``generation`` of ``request_id`` ended; later generations are still welcome."""
        now = time.monotonic()
        old = self._ended.get(request_id)
        if old is not None and old.generation > generation:
            return  # a newer generation already ended: keep the forward-most state
        self._ended.pop(request_id, None)
        self._ended[request_id] = _Ended(generation, drained, now + self._ttl_s)
        self._prune(now)

    def refuses(self, request_id: str, generation: int) -> bool:
        ended = self._live(request_id)
        return ended is not None and generation <= ended.generation

    def abort(self, request_id: str, generation: int) -> bool:
        """Drained answer for an Abort of a transfer that is not running; leaves a tombstone so a
        Prefill of this generation arriving later is refused."""
        ended = self._live(request_id)
        if ended is not None and ended.generation == generation:
            return ended.drained
        if ended is None or generation > ended.generation:
            self.record(request_id, generation, drained=True)  # nothing was, or will be, written
        return True

    def _live(self, request_id: str) -> _Ended | None:
        ended = self._ended.get(request_id)
        if ended is not None and ended.expires < time.monotonic():
            del self._ended[request_id]
            return None
        return ended

    def _prune(self, now: float) -> None:
        while self._ended:
            request_id, oldest = next(iter(self._ended.items()))
            if oldest.expires >= now:
                return
            del self._ended[request_id]
