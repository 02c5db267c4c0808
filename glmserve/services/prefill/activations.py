"""ActivationSlots: the rows through which a LayerSplit stage hands a chunk's outputs to the next.

One registered buffer (the stage's second transfer backend moves its rows, NIXL or TCP, exactly as
KV blocks move): ``recv`` receive slots, which the previous stage writes into, then ``send`` rows,
where this stage packs a chunk's outputs before writing them into a receive slot of the next stage.
A row holds up to ``chunk_tokens`` hidden states [n, hidden] in the model's dtype, then, when the
next stage starts on a `shared` indexer layer, the top-k positions [n, k] as int32 (positions
are below 2**31; exact both ways). Positions themselves need no bytes: a chunk is (start, n).

Slots are handed out in order of request and given back as soon as their bytes are copied out, so
at most ``recv`` chunks are in flight into a stage. Event loop only (the copies are plain memcpys).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

TOPK_DTYPE = torch.int32


@dataclass(frozen=True)
class ActivationShape:
    chunk_tokens: int
    hidden_size: int
    dtype: torch.dtype
    max_topk: int  # index_topk: the widest top-k a chunk carries (0: this link carries none)

    @property
    def hidden_bytes(self) -> int:
        return self.chunk_tokens * self.hidden_size * torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        return self.hidden_bytes + self.chunk_tokens * self.max_topk * TOPK_DTYPE.itemsize


class ActivationSlots:
    def __init__(self, shape: ActivationShape, recv: int, send: int) -> None:
        if recv < 1 or send < 1:
            raise ValueError(f"recv: and send slots must be >= 1, got {recv}, {send}")
        self.shape = shape
        self.recv, self.send = recv, send
        self.buffer = torch.zeros(recv + send, shape.row_bytes, dtype=torch.uint8)
        self._free: dict[str, asyncio.Queue[int]] = {"recv": asyncio.Queue(), "send": asyncio.Queue()}
        for row in range(recv):
            self._free["recv"].put_nowait(row)
        for row in range(recv, recv + send):
            self._free["send"].put_nowait(row)

    async def acquire(self, kind: str) -> int:
        """A free ``"recv"`` or ``"send"`` row (waits for one)."""
        return await self._free[kind].get()

    def release(self, row: int) -> None:
        self._free["recv" if row < self.recv else "send"].put_nowait(row)

    def is_recv(self, row: int) -> bool:
        return 0 <= row < self.recv

    def pack(self, row: int, hidden: torch.Tensor, topk: torch.Tensor | None) -> int:
        """Copy a chunk's outputs into ``row``; returns the top-k width written (0: none)."""
        n = hidden.shape[0]
        s = self.shape
        if n > s.chunk_tokens or hidden.shape[1] != s.hidden_size or hidden.dtype != s.dtype:
            raise ValueError(f"hidden: {tuple(hidden.shape)} {hidden.dtype} does not fit a slot of {s}")
        data = self.buffer[row]
        data[: hidden.numel() * hidden.element_size()].copy_(hidden.contiguous().view(-1).view(torch.uint8))
        if topk is None:
            return 0
        width = topk.shape[1]
        if width > s.max_topk:
            raise ValueError(f"topk: width {width} exceeds the slots' {s.max_topk}")
        data[s.hidden_bytes : s.hidden_bytes + n * width * TOPK_DTYPE.itemsize].copy_(
            topk.to(TOPK_DTYPE).contiguous().view(-1).view(torch.uint8))
        return width

    def unpack(self, row: int, n: int, topk_width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copies of the hidden states [n, hidden] and the top-k [n, width] (int64) in ``row``."""
        s = self.shape
        if not 0 < n <= s.chunk_tokens or topk_width > s.max_topk:
            raise ValueError(f"num_tokens: {n} (top-k width {topk_width}) does not fit a slot of {s}")
        data = self.buffer[row]
        item = torch.empty((), dtype=s.dtype).element_size()
        hidden = data[: n * s.hidden_size * item].clone().view(s.dtype).view(n, s.hidden_size)
        if not topk_width:
            return hidden, None
        raw = data[s.hidden_bytes : s.hidden_bytes + n * topk_width * TOPK_DTYPE.itemsize]
        return hidden, raw.clone().view(TOPK_DTYPE).view(n, topk_width).to(torch.int64)
