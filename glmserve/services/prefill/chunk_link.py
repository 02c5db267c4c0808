"""The link between two stages of a LayerSplit replica: `ChunkSender` on the sending stage,
`ChunkReceiver` on the receiving one.

Per chunk: a receive slot from the next stage (``Slot``: `ChunkReceiver.grant`), the outputs packed
into one of the sender's send rows (`ActivationSlots`), one write of that row into the slot over the
stages' activation backend (NIXL or TCP, as KV blocks move), stamped (request id, generation, and a
`StampPart` naming the receiving stage and the chunk), then ``Chunk``: the receiver checks the stamp
(the exact one must have arrived on its backend, DESIGN invariant 3), copies the slot out and
frees it (`ChunkReceiver.take`). The sender connects to the next stage's slots on first use, from
the ``activation_target`` its Health announces. Slots granted to a job that ended unfilled are
freed only after ``SLOT_QUARANTINE_S`` (the sender's cancelled write may still land).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from glmserve.engine.stage_engine import ChunkOutput
from glmserve.kv.transfer import (
    KVTransferBackend,
    StampPart,
    TransferError,
    TransferHandle,
    TransferStamp,
    verify_stamp,
)
from glmserve.services.prefill.activations import ActivationSlots
from glmserve.services.prefill.stage_job import NextStage, StageJobSpec, StageSettings
from glmserve.services.prefill.write_control import wait_final
from glmserve.services.stamp_waiter import StampWaiter

SLOT_QUARANTINE_S = 10.0  # > a cancelled write's drain


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


class ChunkReceiver:
    def __init__(self, index: int, slots: ActivationSlots, backend: KVTransferBackend) -> None:
        self._index, self._slots, self._backend = index, slots, backend
        self._arrivals = StampWaiter(backend.completions)

    async def grant(self, granted: set[int], live: Callable[[], bool]) -> int:
        """A free receive slot for a job (waits for one); ``granted`` is the job's set."""
        slot = await self._slots.acquire("recv")
        if not live():  # the job ended while we waited: nobody will write it
            self._slots.release(slot)
            raise ValueError("the job has ended on this stage")
        granted.add(slot)
        self._backend.expect_writes(1)  # until the slot is taken or released
        return slot

    async def take(self, granted: set[int], request_id: str, generation: int, chunk: int, slot: int,
                   num_tokens: int, topk_width: int, stamp: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk in ``slot``, once its stamp arrived; the slot is free again afterwards."""
        if slot not in granted:
            raise ValueError(f"slot: {slot} was not granted to this job")
        arrived = TransferStamp.decode(stamp)
        verify_stamp(arrived, request_id=request_id, generation=generation)
        if arrived.part is None or (arrived.part.stage, arrived.part.chunk) != (self._index, chunk):
            raise ValueError(f"stamp: {arrived.part} is not chunk {chunk} for stage {self._index}")
        await self._arrivals.wait(arrived)
        out = self._slots.unpack(slot, num_tokens, topk_width)
        granted.discard(slot)
        self._slots.release(slot)
        self._backend.expect_writes(-1)
        return out

    def release_later(self, granted: set[int]) -> None:
        """A job ended with ``granted`` slots unfilled: free them after the quarantine."""
        if granted:
            slots = list(granted)
            granted.clear()
            asyncio.get_running_loop().call_later(SLOT_QUARANTINE_S, self._release, slots)

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self._slots.release(slot)
        self._backend.expect_writes(-len(slots))
