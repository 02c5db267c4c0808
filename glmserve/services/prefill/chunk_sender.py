"""ChunkSender: hands a stage's chunk outputs to the next stage of its LayerSplit replica.

Per chunk: a receive slot from the next stage (``Slot``), the outputs packed into one of this
stage's send rows (`ActivationSlots`), one write of that row into the slot over the stage's
activation backend (NIXL or TCP, as KV blocks move), stamped (request id, generation, and a
`StampPart` naming the receiving stage and the chunk), then ``Chunk``, which the next stage answers
once it has checked the stamp and copied the slot out. The connection to the next stage's slots
is made on first use, from the ``activation_target`` its Health announces.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from glmserve.engine.stage_engine import ChunkOutput
from glmserve.kv.transfer import KVTransferBackend, StampPart, TransferError, TransferHandle, TransferStamp
from glmserve.services.prefill.activations import ActivationSlots
from glmserve.services.prefill.stage_job import NextStage, StageJobSpec, StageSettings
from glmserve.services.prefill.write_control import wait_final


class ChunkSender:
    def __init__(self, settings: StageSettings, backend: KVTransferBackend, slots: ActivationSlots,
                 next_stage: NextStage) -> None:
        self._settings, self._backend, self._slots, self._next = settings, backend, slots, next_stage
        self.peer: str | None = None  # the next stage's slots, once connected

    async def _link(self) -> str:
        if self.peer is None:
            target = await self._next.activation_target()
            self.peer = await asyncio.to_thread(self._backend.connect, target)
        return self.peer

    async def send(self, spec: StageJobSpec, chunk: int, start: int, out: ChunkOutput, num_chunks: int,
                   live: Callable[[], bool], track: Callable[[TransferHandle], None]) -> None:
        """Send one chunk; raises on any failure. Nothing is written once ``live()`` is False (the
        job is ending); ``track(handle)`` registers the write with the job."""
        s = self._settings
        peer = await self._link()
        slot = await self._next.slot(spec.request_id, spec.generation, chunk)
        row = await self._slots.acquire("send")
        try:
            width = self._slots.pack(row, out.hidden, out.topk if s.sends_topk else None)
            stamp = TransferStamp(spec.request_id, spec.generation,
                                  part=StampPart(s.index + 1, s.num_stages, chunk, num_chunks, 0, 1))
            if not live():
                return
            handle = self._backend.write(peer, stamp, [row], [slot])
            track(handle)
            await wait_final(handle)
        finally:
            self._slots.release(row)
        if handle.state != "done":
            raise TransferError(f"the write into the next stage failed: {handle.error}")
        await self._next.chunk(spec.request_id, spec.generation, chunk, slot, start, out.hidden.shape[0], width,
                               stamp.encode())
