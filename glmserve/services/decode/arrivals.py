"""TransferArrivals: matches KV transfer completions to the decode requests waiting for them.

The receiving backend reports a stamp once every byte of a write landed (``completions()``). A
request registers the exact (request id, generation) it reserved blocks for with ``expect``; a
stamp is handed to it only when ``verify_stamp`` accepts that pair (DESIGN invariant 3). Anything
else is stale and ignored (reported through ``on_stale``): a completion of an older generation, of
a request that gave up (``forget``), or a second completion of the same generation. The checksum,
which needs the destination blocks, is checked later on the engine thread, before the blocks are
used. Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from glmserve.kv.transfer import StaleTransferError, TransferStamp, verify_stamp

log = logging.getLogger(__name__)


class TransferArrivals:
    def __init__(self, on_stale: Callable[[TransferStamp, str], None] | None = None) -> None:
        self._on_stale = on_stale
        self._waiting: dict[str, tuple[int, asyncio.Future[TransferStamp]]] = {}

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def expect(self, request_id: str, generation: int) -> asyncio.Future[TransferStamp]:
        """A future for the completion of exactly this generation. A later generation of the same
        request replaces an earlier one (whose future is cancelled): state only moves forward."""
        old = self._waiting.get(request_id)
        if old is not None:
            if old[0] > generation:
                raise ValueError(f"generation: {generation} of {request_id!r} is older than {old[0]}")
            old[1].cancel()
        future: asyncio.Future[TransferStamp] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (generation, future)
        return future

    def forget(self, request_id: str, generation: int) -> None:
        """Stop waiting; a completion arriving later is stale."""
        entry = self._waiting.get(request_id)
        if entry is not None and entry[0] == generation:
            del self._waiting[request_id]
            entry[1].cancel()

    def deliver(self, stamp: TransferStamp) -> bool:
        """Hand ``stamp`` to the request waiting for it; False (and ``on_stale``) when none is."""
        entry = self._waiting.get(stamp.request_id)
        if entry is None:
            return self._stale(stamp, f"no request {stamp.request_id!r} waits for a transfer")
        generation, future = entry
        try:
            verify_stamp(stamp, request_id=stamp.request_id, generation=generation)
        except StaleTransferError as e:
            return self._stale(stamp, str(e))
        del self._waiting[stamp.request_id]
        if future.done():  # cancelled by its waiter meanwhile
            return self._stale(stamp, "its request stopped waiting")
        future.set_result(stamp)
        return True

    def _stale(self, stamp: TransferStamp, why: str) -> bool:
        log.info("ignoring KV transfer completion %s@%d: %s", stamp.request_id, stamp.generation, why)
        if self._on_stale is not None:
            self._on_stale(stamp, why)
        return False
