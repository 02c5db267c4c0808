"""KVTransferBackend: moves whole KV blocks from a prefill worker's cache into a decode worker's cache.

The contract every backend (NIXL, TCP) keeps:

Both sides
  ``register(buffer)`` once per process: the local cache tensor [num_blocks, ...], one row per
  block, contiguous (one row = one block = one transfer descriptor). The writer's rows are the
  source blocks, the receiver's rows the destination blocks. ``close()`` ends everything; pending
  writes fail.

Receiver (decode)
  ``target_info() -> bytes``: all a writer needs to reach this buffer (opaque; send it to prefill).
  ``completions() -> list[TransferStamp]``: stamps of writes that completed since the last call.
  A stamp arrives only after every byte of its write landed. Before using the blocks, check it
  with ``stamp.verify_stamp`` (request id, current generation, checksum).
  ``expect_writes(delta)``: writes into this buffer are expected (``delta`` more, or fewer when
  negative), from handing out blocks to write until the write is final or given up. A backend whose
  receiver must progress the transport for a write to land (NIXL) progresses it often only while
  some are expected; a write nobody announced still lands, later. ``expecting_writes()``: one
  expected write for the duration of a ``with`` block.

Writer (prefill)
  ``connect(target_info, window=None) -> peer``: once per receiver and window; cached, so calling
  it again is cheap. Without a window both sides' rows have the same size and a write copies whole
  rows; a `BlockWindow` copies bytes ``[src_offset, +length)`` of each source row into
  ``[dst_offset, +length)`` of its destination row (a LayerSplit stage's slice of a whole-model
  block, either way round).
  ``write(peer, stamp, src_block_ids, dst_block_ids) -> TransferHandle``: starts copying source
  row ``src_block_ids[i]`` into destination row ``dst_block_ids[i]``; returns at once (the copy runs
  on a background thread, never on the caller's event loop). For a receiver-side byte check, pass
  ``stamp.with_checksum(source_buffer, src_block_ids)`` (with the window's source bytes).
  ``poll(handle) -> "pending" | "done" | "failed"``: "done" means every byte landed remotely and the
  completion was sent; "failed" is final (peer death, timeout, error, cancel: see ``handle.error``).
  ``cancel(handle, timeout)``: returns only once the writer can guarantee that no more bytes of this
  write will land in the destination blocks (the handle is then ``drained``). When it cannot
  confirm that within ``timeout`` (peer unreachable, connection lost) it raises
  ``TransferDrainError``: the receiver must then keep the blocks until the timeout both sides agreed
  on has passed (DESIGN invariant 2). A write that finished "done" before the cancel stays "done".
  After any failure, ``cancel(handle)`` is also how to learn whether the destination is safe: it
  returns when the failed write is drained and raises otherwise.

Backends are thread-safe: the engine may call them from its loop while copies run.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from glmserve.core.errors import GlmServeError
from glmserve.kv.transfer.stamp import TransferStamp

TransferState = Literal["pending", "done", "failed"]


class TransferError(GlmServeError):
    """A KV transfer could not be set up or carried out."""


@dataclass(frozen=True)
class BlockWindow:
    """The bytes of each block a write moves (see the module docstring); None: whole rows."""

    src_offset: int
    dst_offset: int
    length: int

    def __post_init__(self) -> None:
        if min(self.src_offset, self.dst_offset) < 0 or self.length < 1:
            raise ValueError(f"window: offsets must be >= 0 and length >= 1, got {self}")

    @staticmethod
    def resolve(window: BlockWindow | None, local_block_bytes: int, remote_block_bytes: int) -> BlockWindow:
        """The window a connection uses; raises ValueError when it does not fit both rows."""
        if window is None:
            if local_block_bytes != remote_block_bytes:
                raise ValueError(f"target_info: block size {remote_block_bytes} B != local "
                                 f"{local_block_bytes} B (a window says which bytes to move)")
            return BlockWindow(0, 0, local_block_bytes)
        if window.src_offset + window.length > local_block_bytes:
            raise ValueError(f"window: source bytes {window.src_offset}+{window.length} exceed the local "
                             f"block of {local_block_bytes} B")
        if window.dst_offset + window.length > remote_block_bytes:
            raise ValueError(f"window: destination bytes {window.dst_offset}+{window.length} exceed the "
                             f"receiver's block of {remote_block_bytes} B")
        return window

    def tag(self, whole_row_bytes: int) -> str:
        """Suffix of a peer id: empty for whole rows, so such peers keep their plain names."""
        if self.src_offset == self.dst_offset == 0 and self.length == whole_row_bytes:
            return ""
        return f"#{self.src_offset}:{self.dst_offset}:{self.length}"


class TransferDrainError(TransferError):
    """The writer could not confirm that a cancelled or failed write will put no more bytes in the
    destination blocks; rely on the agreed timeout before reusing them."""


class TransferHandle:
    """One write, seen from the writer. Its backend's thread moves it forward; state never goes back."""

    def __init__(self, stamp: TransferStamp, peer: str, num_blocks: int, num_bytes: int) -> None:
        self.stamp = stamp
        self.peer = peer
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes
        self.bytes_done = 0  # bytes known to have landed (progress, for metrics)
        self.error: str | None = None
        self.cancelled = False
        self.started = time.monotonic()
        self.finished_at: float | None = None
        self.cancel_requested = threading.Event()
        self._lock = threading.Lock()
        self._state: TransferState = "pending"
        self._finished = threading.Event()
        self._drained = False

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def drained(self) -> bool:
        """True once no more bytes of this write can land remotely (always true when "done")."""
        return self._drained

    def finish(
        self, state: Literal["done", "failed"], error: str | None = None, *, drained: bool = True
    ) -> bool:
        """Move to a final state; the first call wins (returns False for later ones). ``drained``:
        no more bytes can land (a "done" write always is)."""
        with self._lock:
            if self._state != "pending":
                return False
            self._state, self.error, self.finished_at = state, error, time.monotonic()
            if drained or state == "done":
                self._drained = True
            self._finished.set()
            return True

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until final or ``timeout`` seconds passed; returns the state then."""
        self._finished.wait(timeout)
        return self._state

    def __repr__(self) -> str:
        return f"TransferHandle({self.stamp.request_id!r}@{self.stamp.generation}, {self._state}, peer={self.peer})"


class KVTransferBackend(ABC):
    """See the module docstring for the contract."""

    kind: ClassVar[str]
    cancel_timeout_s: float = 10.0

    @abstractmethod
    def register(self, buffer: torch.Tensor) -> None: ...

    @abstractmethod
    def target_info(self) -> bytes: ...

    @abstractmethod
    def completions(self) -> list[TransferStamp]: ...

    def expect_writes(self, delta: int) -> None:
        """See the module docstring (receiver); this default has nothing to progress."""
        return None

    @contextmanager
    def expecting_writes(self) -> Iterator[None]:
        """One write into this receiver is expected while the block runs (``expect_writes``)."""
        self.expect_writes(1)
        try:
            yield
        finally:
            self.expect_writes(-1)

    @abstractmethod
    def connect(self, target_info: bytes, window: BlockWindow | None = None) -> str: ...

    @abstractmethod
    def write(
        self, peer: str, stamp: TransferStamp, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> TransferHandle: ...

    def poll(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def cancel(self, handle: TransferHandle, timeout: float | None = None) -> None:
        """Ask the write's thread to stop; it stops between chunks, makes sure nothing more lands
        (backend-specific), then finishes the handle. Raises ``TransferDrainError`` when that was
        not confirmed within ``timeout`` (default ``cancel_timeout_s``)."""
        handle.cancel_requested.set()
        limit = self.cancel_timeout_s if timeout is None else timeout
        if handle.wait(limit) == "pending":
            raise TransferDrainError(f"{handle}: still in flight {limit}s after cancel")
        if not handle.drained:
            raise TransferDrainError(f"{handle}: {handle.error}; cannot confirm no more bytes land")

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVTransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- helpers shared by the backends ----------------------------------------------------------------


def check_buffer(buffer: torch.Tensor) -> tuple[int, int]:
    """(num_blocks, bytes per block) of a cache buffer; raises ValueError if it cannot be registered."""
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"buffer: must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dim() < 2 or buffer.shape[0] < 1 or buffer.numel() == 0:
        raise ValueError(f"buffer: must be [num_blocks, ...] with num_blocks >= 1, got {tuple(buffer.shape)}")
    if not buffer.is_contiguous():
        raise ValueError("buffer: must be contiguous (one row = one contiguous block)")
    return buffer.shape[0], buffer[0].numel() * buffer.element_size()


def check_block_ids(
    src_block_ids: Sequence[int], dst_block_ids: Sequence[int], num_src: int, num_dst: int
) -> tuple[list[int], list[int]]:
    """Validated copies of a write's block ids (same length, in range, no destination twice)."""
    src, dst = list(src_block_ids), list(dst_block_ids)
    if len(src) != len(dst) or not src:
        raise ValueError(f"dst_block_ids: need as many as src_block_ids (>= 1), got {len(dst)} vs {len(src)}")
    for name, ids, limit in (("src_block_ids", src, num_src), ("dst_block_ids", dst, num_dst)):
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < limit:
                raise ValueError(f"{name}: {i!r} is not a block id in [0, {limit})")
    if len(set(dst)) != len(dst):
        raise ValueError("dst_block_ids: a destination block appears twice")
    return src, dst


def encode_info(kind: str, fields: dict[str, Any]) -> bytes:
    return json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()


def decode_info(kind: str, target_info: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(target_info)
    except (ValueError, TypeError) as e:
        raise ValueError(f"target_info: not valid JSON: {e}") from e
    if not isinstance(fields, dict) or fields.get("kind") != kind:
        raise ValueError(
            f"target_info: not a {kind} target (kind={fields.get('kind') if isinstance(fields, dict) else None!r})"
        )
    return fields


# -- throughput ------------------------------------------------------------------------------------


def measure_write_throughput(
    backend: KVTransferBackend,
    peer: str,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    *,
    repeats: int = 3,
    timeout: float = 60.0,
) -> float:
    """Best of ``repeats`` writes of these blocks, in bytes/s (write() call to "done", no checksum)."""
    best = 0.0
    for i in range(repeats):
        start = time.perf_counter()
        handle = backend.write(peer, TransferStamp(f"throughput-{i}", i), src_block_ids, dst_block_ids)
        if handle.wait(timeout) != "done":
            raise TransferError(f"throughput write {i} did not finish: {handle.state} {handle.error}")
        best = max(best, handle.num_bytes / (time.perf_counter() - start))
    return best


def memcpy_throughput(num_blocks: int, block_bytes: int, *, repeats: int = 3) -> float:
    """Best of ``repeats`` in-process ``torch`` copies of num_blocks * block_bytes bytes, in bytes/s:
    the limit a same-host transfer can approach."""
    src = torch.ones(num_blocks, block_bytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched: page faults are not part of the copy
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, src.numel() / (time.perf_counter() - start))
    return best
