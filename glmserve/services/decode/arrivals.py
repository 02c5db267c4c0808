"""TransferArrivals: matches KV transfer completions to the decode requests waiting for them.

The receiving backend reports a stamp once every byte of a write landed (``completions()``). A
request registers the exact (request id, generation) it reserved blocks for with ``expect``; a
stamp is handed to it only when ``verify_stamp`` accepts that pair (DESIGN invariant 3). Anything
else is stale and ignored (reported through ``on_stale``): a completion of an older generation, of
a request that gave up (``forget``), or a second completion of the same generation (or part). The
checksum, which needs the destination blocks, is checked later on the engine thread, before the
blocks are used. Event loop only.

A LayerSplit replica writes a transfer in parts (each stage its slice, chunk by chunk; every stamp
carries a `StampPart`): the future completes only once every chunk of every stage has arrived, with
all the parts' stamps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from glmserve.kv.transfer import StaleTransferError, TransferStamp, verify_stamp

log = logging.getLogger(__name__)
Arrived = tuple[TransferStamp, ...]


class _Parts:
    """The parts of one split transfer seen so far."""

    def __init__(self) -> None:
        self.stamps: dict[tuple[int, int], TransferStamp] = {}  # (stage, chunk) -> stamp
        self.chunks: dict[int, int] = {}  # stage -> chunks it writes
        self.stages = 0

    def add(self, stamp: TransferStamp) -> str | None:
        """None when taken, else why it is stale."""
        p = stamp.part
        assert p is not None
        if self.stages and (p.stages != self.stages or self.chunks.get(p.stage, p.chunks) != p.chunks):
            return f"part {p} does not match the parts already arrived"
        if (p.stage, p.chunk) in self.stamps:
            return f"a second completion of stage {p.stage} chunk {p.chunk}"
        self.stages, self.chunks[p.stage] = p.stages, p.chunks
        self.stamps[(p.stage, p.chunk)] = stamp
        return None

    @property
    def complete(self) -> bool:
        return len(self.chunks) == self.stages and len(self.stamps) == sum(self.chunks.values())


class TransferArrivals:
    def __init__(self, on_stale: Callable[[TransferStamp, str], None] | None = None) -> None:
        self._on_stale = on_stale
        self._waiting: dict[str, tuple[int, asyncio.Future[Arrived], _Parts]] = {}

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def expect(self, request_id: str, generation: int) -> asyncio.Future[Arrived]:
        """A future for the completion of exactly this generation (its stamps: one, or every part).
        A later generation of the same request replaces an earlier one (whose future is
        cancelled): state only moves forward."""
        old = self._waiting.get(request_id)
        if old is not None:
            if old[0] > generation:
                raise ValueError(f"generation: {generation} of {request_id!r} is older than {old[0]}")
            old[1].cancel()
        future: asyncio.Future[Arrived] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (generation, future, _Parts())
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
        generation, future, parts = entry
        try:
            verify_stamp(stamp, request_id=stamp.request_id, generation=generation)
        except StaleTransferError as e:
            return self._stale(stamp, str(e))
        if future.done():  # cancelled by its waiter meanwhile
            del self._waiting[stamp.request_id]
            return self._stale(stamp, "its request stopped waiting")
        if stamp.part is None:
            if parts.stamps:
                return self._stale(stamp, "a whole-transfer stamp among parts")
            del self._waiting[stamp.request_id]
            future.set_result((stamp,))
            return True
        why = parts.add(stamp)
        if why is not None:
            return self._stale(stamp, why)
        if parts.complete:
            del self._waiting[stamp.request_id]
            future.set_result(tuple(parts.stamps[k] for k in sorted(parts.stamps)))
        return True

    def _stale(self, stamp: TransferStamp, why: str) -> bool:
        log.info("ignoring KV transfer completion %s@%d: %s", stamp.request_id, stamp.generation, why)
        if self._on_stale is not None:
            self._on_stale(stamp, why)
        return False
