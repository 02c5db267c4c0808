"""TcpTransferBackend: the KVTransferBackend contract over one plain TCP stream per writer/receiver pair.

The fallback when NIXL is missing or ``--transfer tcp`` is asked for. The receiver listens (a thread
per connection, blocking sockets) and copies each DATA frame straight into the destination row
(``recv_into`` on the row's memory: no staging copy). CPU buffers only.

Frames, writer -> receiver: header ``!BIIQI`` (kind, write id, block, offset, length), then
``length`` payload bytes.
  BEGIN  block = number of blocks, offset = total bytes, payload = the encoded stamp
  DATA   block = destination block id, offset = byte offset in that block, payload = the bytes
  END    the write is complete: the receiver checks the byte count, queues the stamp, replies DONE
  ABORT  the writer stops the write: the receiver forgets it and replies ABORTED
Replies, receiver -> writer: ``!BI`` (kind, write id): DONE, ABORTED, FAILED.

Cancel relies on ordering: one stream, read in order by one receiver thread. When ABORTED arrives,
every DATA frame sent before the ABORT has been copied, and no DATA of that write follows it; so the
write is drained. If the connection dies before that, bytes the receiver had already buffered may
still be copied: the handle is not drained and ``cancel`` raises ``TransferDrainError``. A dead peer
shows up as EOF or a reset on the connection, and every pending write on it fails at once.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import torch

from glmserve.kv.transfer.base import (
    BlockWindow,
    KVTransferBackend,
    TransferError,
    TransferHandle,
    check_block_ids,
    check_buffer,
    decode_info,
    encode_info,
)
from glmserve.kv.transfer.stamp import MAX_ENCODED_BYTES, TransferStamp
from glmserve.kv.transfer.timeouts import AGREED

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!BIIQI")
_REPLY = struct.Struct("!BI")
BEGIN, DATA, END, ABORT = 1, 2, 3, 4
DONE, ABORTED, FAILED = 1, 2, 3


def _recv_exact(sock: socket.socket, view: memoryview, alive: Callable[[], bool]) -> bool:
    """Fill ``view`` from ``sock``; False on EOF. Socket timeouts only re-check ``alive``."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if not alive():
                return False
            continue
        if n == 0:
            return False
        got += n
    return True


def _flat_bytes(buffer: torch.Tensor) -> memoryview:
    if buffer.device.type != "cpu":
        raise ValueError(f"buffer: the TCP backend needs a CPU buffer, got {buffer.device}")
    return memoryview(buffer.view(-1).view(torch.uint8).numpy())


class _Connection:
    """Writer side of one peer: the socket, the frame lock, and the writes waiting for a reply."""

    def __init__(self, sock: socket.socket, peer: str, num_blocks: int) -> None:
        self.sock, self.peer, self.num_blocks = sock, peer, num_blocks
        self.send_lock = threading.Lock()
        self.pending: dict[int, TransferHandle] = {}
        self.ids = itertools.count(1)
        self.alive = True

    def send(
        self, kind: int, write_id: int, block: int = 0, offset: int = 0, payload: bytes | memoryview = b""
    ) -> None:
        with self.send_lock:  # frames of concurrent writes interleave, never their bytes
            self.sock.sendall(_HEADER.pack(kind, write_id, block, offset, len(payload)))
            if payload:
                self.sock.sendall(payload)

    def fail(self, reason: str) -> None:
        """The connection is gone: every pending write fails, not drained."""
        self.alive = False
        for handle in list(self.pending.values()):
            handle.finish("failed", reason, drained=False)
        self.pending.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpTransferBackend(KVTransferBackend):
    kind = "tcp"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = AGREED.write_s,
        drain_timeout_s: float = AGREED.drain_s,
    ) -> None:
        """``host``/``port``: where a receiver listens (port 0: any free port)."""
        for field, value in (
            ("chunk_bytes", chunk_bytes),
            ("timeout_s", timeout_s),
            ("drain_timeout_s", drain_timeout_s),
        ):
            if value <= 0:
                raise ValueError(f"{field}: must be > 0, got {value!r}")
        self._host, self._port = host, port
        self._chunk_bytes, self._timeout_s, self._drain_timeout_s = chunk_bytes, timeout_s, drain_timeout_s
        self.cancel_timeout_s = timeout_s + drain_timeout_s
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._flat: memoryview | None = None
        self._num_blocks = self._block_bytes = 0
        self._listener: socket.socket | None = None
        self._accepted: list[socket.socket] = []
        self._completed: queue.SimpleQueue[TransferStamp] = queue.SimpleQueue()
        self._conns: dict[str, _Connection] = {}  # by receiver address
        self._peers: dict[str, tuple[str, BlockWindow]] = {}  # peer id -> (address, window)
        self._closed = False

    # -- both sides --------------------------------------------------------------------------------

    def register(self, buffer: torch.Tensor) -> None:
        num_blocks, block_bytes = check_buffer(buffer)
        if self._buffer is not None:
            raise ValueError("buffer: already registered (register once per process)")
        self._flat = _flat_bytes(buffer)
        self._buffer, self._num_blocks, self._block_bytes = buffer, num_blocks, block_bytes

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, accepted = list(self._conns.values()), list(self._accepted)
        for conn in conns:
            for handle in list(conn.pending.values()):
                handle.cancel_requested.set()
            conn.fail("backend closed")
        for sock in accepted:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv
            except OSError:
                pass
        if self._listener is not None:
            self._listener.close()

    # -- receiver ----------------------------------------------------------------------------------

    def target_info(self) -> bytes:
        if self._buffer is None:
            raise TransferError("target_info: register a buffer first")
        with self._lock:
            if self._listener is None:
                self._listener = socket.create_server((self._host, self._port))
                self._listener.settimeout(0.2)  # accept re-checks _closed
                threading.Thread(target=self._accept_loop, daemon=True).start()
            host, port = self._listener.getsockname()[:2]
        return encode_info(
            self.kind,
            {"host": host, "port": port, "num_blocks": self._num_blocks, "block_bytes": self._block_bytes},
        )

    def completions(self) -> list[TransferStamp]:
        stamps: list[TransferStamp] = []
        while not self._completed.empty():
            stamps.append(self._completed.get_nowait())
        return stamps

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(None)
            with self._lock:
                self._accepted.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """One writer's frames, in order. A protocol error closes the connection (the writer's
        pending writes then fail)."""
        assert self._flat is not None
        header = bytearray(_HEADER.size)
        writes: dict[int, list] = {}  # write id -> [stamp, expected bytes, received bytes]
        alive = lambda: not self._closed  # noqa: E731
        try:
            while _recv_exact(sock, memoryview(header), alive):
                kind, write_id, block, offset, length = _HEADER.unpack(header)
                if kind == BEGIN:
                    if length > MAX_ENCODED_BYTES:
                        raise ValueError(f"stamp of {length} bytes")
                    stamp = bytearray(length)
                    if not _recv_exact(sock, memoryview(stamp), alive):
                        break
                    writes[write_id] = [TransferStamp.decode(bytes(stamp)), offset, 0]
                elif kind == DATA:
                    if (
                        write_id not in writes
                        or block >= self._num_blocks
                        or offset + length > self._block_bytes
                    ):
                        raise ValueError(f"DATA for write {write_id}, block {block}, bytes {offset}+{length}")
                    start = block * self._block_bytes + offset
                    if not _recv_exact(sock, self._flat[start : start + length], alive):
                        break
                    writes[write_id][2] += length
                elif kind == END:
                    stamp, expected, received = writes.pop(write_id)
                    if received == expected:
                        self._completed.put(stamp)
                    sock.sendall(_REPLY.pack(DONE if received == expected else FAILED, write_id))
                elif kind == ABORT:
                    writes.pop(write_id, None)
                    sock.sendall(_REPLY.pack(ABORTED, write_id))
                else:
                    raise ValueError(f"frame kind {kind}")
        except (OSError, ValueError, KeyError) as e:
            if not self._closed:
                logger.warning("closing a KV transfer connection: %s: %s", type(e).__name__, e)
        finally:
            sock.close()

    # -- writer ------------------------------------------------------------------------------------

    def connect(self, target_info: bytes, window: BlockWindow | None = None) -> str:
        info = decode_info(self.kind, target_info)
        if self._buffer is None:
            raise TransferError("connect: register the source buffer first")
        window = BlockWindow.resolve(window, self._block_bytes, info["block_bytes"])
        address = f"{info['host']}:{info['port']}"
        peer = address + window.tag(self._block_bytes)
        with self._lock:
            if self._closed:
                raise TransferError("connect: backend is closed")
            self._peers[peer] = (address, window)
            conn = self._conns.get(address)
            if conn is not None and conn.alive:
                return peer
            sock = socket.create_connection((info["host"], info["port"]), timeout=self._timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, address, info["num_blocks"])
            self._conns[address] = conn
        threading.Thread(target=self._read_replies, args=(conn,), daemon=True).start()
        return peer

    def write(
        self, peer: str, stamp: TransferStamp, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> TransferHandle:
        address, window = self._peers.get(peer, (peer, None))
        conn = self._conns.get(address) if window is not None else None
        if conn is None or window is None:
            raise ValueError(f"peer: {peer!r} is not connected")
        src, dst = check_block_ids(src_block_ids, dst_block_ids, self._num_blocks, conn.num_blocks)
        handle = TransferHandle(stamp, peer, len(src), len(src) * window.length)
        if self._closed or not conn.alive:
            handle.finish("failed", "peer disconnected" if not self._closed else "backend closed")
            return handle  # nothing was sent: failed and drained
        write_id = next(conn.ids)
        conn.pending[write_id] = handle
        threading.Thread(target=self._run, args=(conn, write_id, handle, src, dst, window), daemon=True).start()
        return handle

    def _run(
        self, conn: _Connection, write_id: int, handle: TransferHandle, src: list[int], dst: list[int],
        window: BlockWindow,
    ) -> None:
        """The write's thread: frames out; the reply reader finishes the handle."""
        assert self._flat is not None
        deadline = handle.started + self._timeout_s
        try:
            conn.send(BEGIN, write_id, len(src), handle.num_bytes, handle.stamp.encode())
            for s, d in zip(src, dst, strict=True):
                for offset in range(0, window.length, self._chunk_bytes):
                    if handle.cancel_requested.is_set() or time.monotonic() > deadline:
                        handle.cancelled = handle.cancel_requested.is_set()
                        conn.send(ABORT, write_id)
                        self._await_reply(handle, self._drain_timeout_s)
                        return
                    length = min(self._chunk_bytes, window.length - offset)
                    start = s * self._block_bytes + window.src_offset + offset
                    conn.send(DATA, write_id, d, window.dst_offset + offset, self._flat[start : start + length])
                    handle.bytes_done += length  # sent; landed only once DONE comes back
            conn.send(END, write_id)
            self._await_reply(handle, max(0.0, deadline - time.monotonic()))
        except OSError as e:
            conn.fail(f"peer disconnected: {type(e).__name__}: {e}")

    def _await_reply(self, handle: TransferHandle, timeout: float) -> None:
        if handle.wait(timeout) == "pending":
            handle.finish("failed", f"no reply from the receiver within {timeout:.1f}s", drained=False)

    def _read_replies(self, conn: _Connection) -> None:
        reply = bytearray(_REPLY.size)
        try:
            while _recv_exact(conn.sock, memoryview(reply), lambda: conn.alive):
                kind, write_id = _REPLY.unpack(reply)
                handle = conn.pending.pop(write_id, None)
                if handle is None:
                    continue
                if kind == DONE:
                    handle.finish("done")
                elif kind == ABORTED:
                    handle.finish(
                        "failed", "cancelled" if handle.cancelled else f"timed out after {self._timeout_s}s"
                    )
                else:
                    handle.finish("failed", "the receiver got fewer bytes than announced")
        except OSError:
            pass
        if conn.alive:
            conn.fail("peer disconnected")
