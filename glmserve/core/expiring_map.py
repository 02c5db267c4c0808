"""ExpiringMap: a bounded string -> bytes map whose entries expire a TTL after they were written.

For records a process keeps on behalf of clients for a while (stored Responses): bounded by entry
count and total bytes (the oldest entries go first when either bound is reached), expired entries
are dropped lazily. Pure logic; the clock is injectable for tests. Not thread-safe: callers on
several threads hold their own lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class ExpiringMap:
    def __init__(self, max_entries: int = 10_000, max_bytes: int = 256 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: must be >= 1, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes}")
        self.max_entries, self.max_bytes, self._clock = max_entries, max_bytes, clock
        # Ordered by write time: the oldest entry is at the front.
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, key: str, value: bytes, ttl_s: float) -> bool:
        """Keep ``value`` under ``key`` for ``ttl_s`` seconds; False (nothing kept) when it alone
        is larger than ``max_bytes``."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self._drop(key)
        if len(value) > self.max_bytes:
            return False
        self._entries[key] = (value, self._clock() + ttl_s)
        self._bytes += len(value)
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None when absent or expired."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires = entry
        if self._clock() >= expires:
            self._drop(key)
            return None
        return value

    def delete(self, key: str) -> bool:
        """Forget ``key``; False when it was absent or already expired."""
        found = self.get(key) is not None
        self._drop(key)
        return found

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[0])
