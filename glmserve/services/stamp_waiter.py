"""StampWaiter: awaits the completion of one exact write on a receiving transfer backend.

A receiver learns that a write landed from its backend's ``completions()`` (a stamp arrives only
after every byte did). A worker that is told "your blocks were written" over gRPC then waits here
for exactly that stamp, (request id, generation) and part included, before it reads the blocks
(DESIGN invariant 3): an older generation's, or another part's, never matches. Stamps nobody waits
for (a job that was aborted meanwhile) are kept up to ``keep`` and then dropped, oldest first.
Event loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from glmserve.kv.transfer import TransferStamp


class StampWaiter:
    def __init__(self, completions: Callable[[], list[TransferStamp]], *, poll_interval_s: float = 0.001,
                 keep: int = 4096) -> None:
        self._completions = completions
        self._poll_s, self._keep = poll_interval_s, keep
        self._arrived: OrderedDict[TransferStamp, None] = OrderedDict()

    def _collect(self) -> None:
        for stamp in self._completions():
            self._arrived[stamp] = None
        while len(self._arrived) > self._keep:
            self._arrived.popitem(last=False)

    async def wait(self, expected: TransferStamp, timeout_s: float = 5.0) -> None:
        """Returns once ``expected`` arrived (and forgets it); raises TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._collect()
            if expected in self._arrived:
                del self._arrived[expected]
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no completion for {expected.request_id}@{expected.generation}")
            await asyncio.sleep(self._poll_s)
