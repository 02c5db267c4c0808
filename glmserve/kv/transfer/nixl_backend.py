"""NixlTransferBackend: KV blocks written with NIXL (UCX) straight into the receiver's registered cache.

Setup: each process makes one NIXL agent with the UCX backend and registers its cache buffer once.
The receiver's ``target_info`` carries its agent metadata and the buffer's address, block count,
block size, memory type and device. ``connect`` loads it (``add_remote_agent``) and prepares the
peer's descriptor list, one descriptor per block plus one 64-byte fence descriptor; the local list
(our rows plus a 64-byte scratch) is prepared once at ``register``. A `BlockWindow` makes both lists
describe only the window's bytes of each row (a peer per receiver and window; one remote agent). A write is
``make_prepped_xfer`` by block index, in chunks of about ``chunk_bytes``; the last chunk carries the
encoded stamp as NIXL's notification, which the receiver reads in ``completions``.

What NIXL 1.5.1 guarantees, as read in its UCX backend and measured on this host (UCX uses CMA for
same-host DRAM puts, TCP over loopback for notifications, with ``ucx_error_handling_mode=peer``):
- A request is DONE only after UCX flushed the endpoint (NIXL appends ``ucp_ep_flush`` to every
  request): "done" means the bytes are in the receiver's memory; the notification is sent after.
- With CMA, ``transfer()`` copies synchronously (process_vm_writev) inside the call, with the GIL
  released. Hence a thread per write, and chunks: cancel takes effect between chunks.
- Releasing a request that is still in progress calls ``ucp_request_cancel``, frees it and drops its
  notification, and reports success although bytes already handed to the transport may still land
  (NIXL's own comment: "it may not be enough to cancel UCX request"). So after such a release, and
  after any failed request, we post a fence: a 64-byte READ from the peer on the same endpoint
  (one UCX worker). Its DONE implies the endpoint flush covered every earlier operation, so nothing
  of the stopped write lands afterwards; the handle is then ``drained``.
- Peer death: ``transfer`` / ``check_xfer_state`` raise ``nixlRemoteDisconnectError`` (kill -9 of the
  receiver mid-write is seen within milliseconds here). The fence then fails as well: the handle is
  failed and not drained, and ``cancel`` raises ``TransferDrainError``.
- A request still in progress after ``timeout_s`` is released, fenced and failed.
- UCX's TCP transport listens on every network interface unless UCX_NET_DEVICES names some: with
  ``host`` given, only the interfaces holding that address (DESIGN invariant 9).
- A write completes only while the receiver progresses its UCX worker as well (measured: without
  that, not even the first chunk finishes). NIXL's progress thread would do it, but 1.5.1 runs it
  as a busy loop; a receiver here polls every ``progress_interval_s`` while writes are expected
  (``expect_writes``) and every ``idle_progress_interval_s`` otherwise (a busy loop took ~0.3-0.5
  of a core per idle receiver, polling every millisecond ~2.4%, idle polling ~0).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
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
from glmserve.kv.transfer.net_devices import interfaces_for
from glmserve.kv.transfer.stamp import TransferStamp
from glmserve.kv.transfer.timeouts import AGREED

logger = logging.getLogger(__name__)

FENCE_BYTES = 64


def import_nixl() -> Any:
    """The ``nixl`` module; quiet unless asked (it reads NIXL_LOG_LEVEL, which wants WARN, not WARNING)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import nixl

    return nixl


@contextlib.contextmanager
def _ucx_net_devices(devices: list[str] | None) -> Iterator[None]:
    """UCX_NET_DEVICES while UCX reads its configuration (at backend creation), unless the user
    set it. The ``ucx_devices`` backend parameter of NIXL 1.5.1 did not stop the TCP transport from
    listening on other interfaces (measured); the environment variable does."""
    if devices is None or "UCX_NET_DEVICES" in os.environ:
        yield
        return
    os.environ["UCX_NET_DEVICES"] = ",".join(devices)
    try:
        yield
    finally:
        os.environ.pop("UCX_NET_DEVICES", None)


@dataclass
class _Peer:
    agent: str
    remote: Any  # prepared remote descriptor list: blocks 0..num_blocks-1 (their window), then the fence
    num_blocks: int
    local: Any  # prepared local descriptor list for the window: our rows, then the scratch
    window_bytes: int  # bytes moved per block


def _descs(addr: int, num_blocks: int, stride: int, length: int, device: int, fence: tuple[int, int]) -> np.ndarray:
    """Nx3 (address, length, device) rows: one per block (``length`` bytes every ``stride``), then
    one for the fence."""
    rows = np.empty((num_blocks + 1, 3), dtype=np.uint64)
    rows[:-1, 0] = addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(stride)
    rows[:-1, 1] = length
    rows[-1, 0], rows[-1, 1] = fence
    rows[:, 2] = device
    return rows


class NixlTransferBackend(KVTransferBackend):
    kind = "nixl"

    def __init__(
        self,
        *,
        name: str | None = None,
        chunk_bytes: int = 16 << 20,
        timeout_s: float = AGREED.write_s,
        drain_timeout_s: float = AGREED.drain_s,
        error_handling: str = "peer",
        poll_interval_s: float = 0.0002,
        progress_interval_s: float = 0.001,
        idle_progress_interval_s: float = 0.02,
        host: str | None = None,
    ) -> None:
        """``host``: the address this process serves on; UCX then listens only on the interfaces
        holding it (None or a wildcard: every interface; UCX_NET_DEVICES, when set, wins).
        ``error_handling``: UCX's ``peer`` (default: peer failures are reported; UCX then uses CMA
        and TCP here) or ``none`` (needed for UCX's posix/sysv shared-memory transports; a dead peer
        may then go unnoticed until ``timeout_s``). ``progress_interval_s``: how often a receiver
        progresses its UCX worker (what a write into it waits for at most per round trip)."""
        for field, value in (
            ("chunk_bytes", chunk_bytes),
            ("timeout_s", timeout_s),
            ("drain_timeout_s", drain_timeout_s),
            ("progress_interval_s", progress_interval_s),
            ("idle_progress_interval_s", idle_progress_interval_s),
        ):
            if value <= 0:
                raise ValueError(f"{field}: must be > 0, got {value!r}")
        if error_handling not in ("peer", "none"):
            raise ValueError(f"error_handling: must be 'peer' or 'none', got {error_handling!r}")
        nixl = import_nixl()
        self.name = name or f"glmserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._chunk_bytes, self._timeout_s = chunk_bytes, timeout_s
        self._drain_timeout_s, self._poll_s = drain_timeout_s, poll_interval_s
        self.cancel_timeout_s = timeout_s + drain_timeout_s
        # STRICT: write threads, the receiver's progress thread and the caller share the agent.
        # No NIXL progress thread: nixl 1.5.1 runs it with a poll delay of 0, a busy loop that takes
        # ~0.3-0.5 of a core per idle worker. A writer's thread progresses its own requests
        # (transfer / check_xfer_state); a receiver must progress too, or writes into it never
        # finish, which ``_progress_loop`` does at ``progress_interval_s`` (see ``target_info``).
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, backends=[], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        with _ucx_net_devices(interfaces_for(host) if host is not None else None):
            self._agent = nixl.nixl_agent(self.name, config)
            # One worker, so a fence shares the endpoint of the write it fences.
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": error_handling, "num_workers": "1"})
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._regs: list[Any] = []
        self._local: Any = None
        self._windows: dict[tuple[int, int], Any] = {}
        self._num_blocks = self._block_bytes = 0
        self._peers: dict[str, _Peer] = {}
        self._agents: set[str] = set()  # remote agents loaded (one per receiver, whatever the windows)
        self._threads: dict[TransferHandle, threading.Thread] = {}
        self._closed = False
        self._progress_interval_s, self._idle_progress_interval_s = progress_interval_s, idle_progress_interval_s
        self._expected_writes = 0
        self._writes_expected = threading.Event()  # set while _expected_writes > 0, and on close
        self._progress: threading.Thread | None = None  # started by target_info: receivers only
        self._stop_progress = threading.Event()
        self._notifs: list[tuple[str, bytes]] = []  # read by the progress thread, not yet returned

    # -- both sides --------------------------------------------------------------------------------

    def register(self, buffer: torch.Tensor) -> None:
        num_blocks, block_bytes = check_buffer(buffer)
        if self._buffer is not None:
            raise ValueError("buffer: already registered (register once per process)")
        mem, device = ("VRAM", buffer.get_device()) if buffer.is_cuda else ("DRAM", 0)
        scratch = torch.zeros(FENCE_BYTES, dtype=torch.uint8, device=buffer.device)
        addr, size = buffer.data_ptr(), num_blocks * block_bytes
        self._regs = [
            self._agent.register_memory([(addr, size, device, "")], mem),
            self._agent.register_memory([(scratch.data_ptr(), FENCE_BYTES, device, "")], mem),
        ]
        rows = _descs(addr, num_blocks, block_bytes, block_bytes, device, (scratch.data_ptr(), FENCE_BYTES))
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem)
        self._windows = {(0, block_bytes): self._local}  # local descriptor lists by (offset, length)
        self._buffer, self._scratch = buffer, scratch
        self._num_blocks, self._block_bytes, self._mem, self._device = num_blocks, block_bytes, mem, device

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = dict(self._threads)
        self._stop_progress.set()
        self._writes_expected.set()  # wakes an idle progress loop
        if self._progress is not None:
            self._progress.join()
        for handle in threads:
            handle.cancel_requested.set()
        for thread in threads.values():
            thread.join(self._drain_timeout_s + 1.0)
        if any(t.is_alive() for t in threads.values()):
            # Deregistering memory a live request may still touch would be unsafe: leave it to exit.
            logger.error("NIXL writes still running at close; memory stays registered")
            return
        for peer in self._peers.values():
            self._quietly(peer.remote.release)
        for agent in self._agents:
            self._quietly(lambda a=agent: self._agent.remove_remote_agent(a))
        for local in self._windows.values():
            self._quietly(local.release)
        for reg in self._regs:
            self._quietly(lambda r=reg: self._agent.deregister_memory(r))
        self._peers.clear()
        self._agents.clear()
        self._windows.clear()
        self._regs = []

    # -- receiver ----------------------------------------------------------------------------------

    def target_info(self) -> bytes:
        if self._buffer is None:
            raise TransferError("target_info: register a buffer first")
        metadata = self._agent.get_agent_metadata()  # after registration: it carries the memory keys
        with self._lock:  # whoever hands out target_info receives writes: progress from now on
            if self._progress is None and not self._closed:
                self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True)
                self._progress.start()
        return encode_info(
            self.kind,
            {
                "agent": self.name,
                "metadata": base64.b64encode(metadata).decode(),
                "addr": self._buffer.data_ptr(),
                "num_blocks": self._num_blocks,
                "block_bytes": self._block_bytes,
                "mem": self._mem,
                "device": self._device,
            },
        )

    def completions(self) -> list[TransferStamp]:
        self._read_notifs()
        with self._lock:
            notifs, self._notifs = self._notifs, []
        stamps: list[TransferStamp] = []
        for agent, message in notifs:
            try:
                stamps.append(TransferStamp.decode(message))
            except ValueError:
                logger.warning("ignoring a NIXL notification from %s that is no stamp: %r", agent, message[:64])
        return stamps

    def _read_notifs(self) -> None:
        """Progress the UCX worker (get_new_notifs does) and keep what arrived for ``completions``."""
        arrived = self._agent.get_new_notifs()
        if arrived:
            with self._lock:
                self._notifs += [(agent, m) for agent, messages in arrived.items() for m in messages]

    def expect_writes(self, delta: int) -> None:
        with self._lock:
            self._expected_writes = max(0, self._expected_writes + delta)
            if self._expected_writes:
                self._writes_expected.set()
            elif not self._closed:
                self._writes_expected.clear()

    def _progress_loop(self) -> None:
        while not self._stop_progress.is_set():
            if self._writes_expected.is_set():
                time.sleep(self._progress_interval_s)
            else:  # returns at once when a write is announced
                self._writes_expected.wait(self._idle_progress_interval_s)
            if self._stop_progress.is_set():
                return
            try:
                self._read_notifs()
            except Exception:  # keep progressing: a stuck receiver would stall every writer
                logger.exception("NIXL progress failed")

    # -- writer ------------------------------------------------------------------------------------

    def connect(self, target_info: bytes, window: BlockWindow | None = None) -> str:
        info = decode_info(self.kind, target_info)
        if self._buffer is None:
            raise TransferError("connect: register the source buffer first")
        window = BlockWindow.resolve(window, self._block_bytes, info["block_bytes"])
        peer = info["agent"] + window.tag(self._block_bytes)
        with self._lock:
            if self._closed:
                raise TransferError("connect: backend is closed")
            if peer in self._peers:
                return peer
            agent = info["agent"]
            if agent not in self._agents:
                loaded = self._agent.add_remote_agent(base64.b64decode(info["metadata"]))
                agent = loaded.decode() if isinstance(loaded, bytes) else loaded  # 1.5.1 returns bytes
                self._agent.make_connection(agent)  # fail here, not on the first write
                self._agents.add(agent)
            rows = _descs(info["addr"] + window.dst_offset, info["num_blocks"], info["block_bytes"],
                          window.length, info["device"], (info["addr"], FENCE_BYTES))
            remote = self._agent.prep_xfer_dlist(agent, rows, info["mem"])
            self._peers[peer] = _Peer(agent, remote, info["num_blocks"], self._local_window(window), window.length)
            return peer

    def _local_window(self, window: BlockWindow) -> Any:
        """Our rows' descriptor list for the window's source bytes (prepared once per window)."""
        key = (window.src_offset, window.length)
        if key not in self._windows:
            assert self._buffer is not None and self._scratch is not None
            rows = _descs(self._buffer.data_ptr() + window.src_offset, self._num_blocks, self._block_bytes,
                          window.length, self._device, (self._scratch.data_ptr(), FENCE_BYTES))
            self._windows[key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem)
        return self._windows[key]

    def write(
        self, peer: str, stamp: TransferStamp, src_block_ids: Sequence[int], dst_block_ids: Sequence[int]
    ) -> TransferHandle:
        target = self._peers.get(peer)
        if target is None:
            raise ValueError(f"peer: {peer!r} is not connected")
        src, dst = check_block_ids(src_block_ids, dst_block_ids, self._num_blocks, target.num_blocks)
        handle = TransferHandle(stamp, peer, len(src), len(src) * target.window_bytes)
        thread = threading.Thread(target=self._run, args=(handle, target, src, dst), daemon=True)
        with self._lock:
            if self._closed:
                raise TransferError("write: backend is closed")
            self._threads[handle] = thread
        thread.start()
        return handle

    def _run(self, handle: TransferHandle, peer: _Peer, src: list[int], dst: list[int]) -> None:
        """The write's thread: chunk after chunk, each DONE (flushed) before the next is posted."""
        per_chunk = max(1, self._chunk_bytes // peer.window_bytes)
        deadline = handle.started + self._timeout_s
        try:
            for start in range(0, len(src), per_chunk):
                end = min(len(src), start + per_chunk)
                if handle.cancel_requested.is_set():  # nothing in flight: earlier chunks are DONE
                    handle.cancelled = True
                    handle.finish("failed", "cancelled")
                    return
                notif = handle.stamp.encode() if end == len(src) else b""
                why = self._post(peer, src[start:end], dst[start:end], notif, handle, deadline)
                if why is not None:
                    handle.cancelled = why.startswith("cancelled")
                    handle.finish("failed", why, drained=self._fence(peer))
                    return
                handle.bytes_done += (end - start) * peer.window_bytes
            handle.finish("done")
        except Exception as e:  # nixl raises from post/check, e.g. nixlRemoteDisconnectError
            handle.finish("failed", f"{type(e).__name__}: {e}", drained=self._fence(peer))
        finally:
            with self._lock:
                self._threads.pop(handle, None)

    def _post(
        self,
        peer: _Peer,
        src: list[int],
        dst: list[int],
        notif: bytes,
        handle: TransferHandle,
        deadline: float,
    ) -> str | None:
        """Post one chunk and wait for it: None when DONE, else why it stopped."""
        xfer = self._agent.make_prepped_xfer("WRITE", peer.local, src, peer.remote, dst, notif)
        try:
            state = self._agent.transfer(xfer)
            while state == "PROC":
                if handle.cancel_requested.is_set():
                    return "cancelled in flight"
                if time.monotonic() > deadline:
                    return f"timed out after {self._timeout_s}s"
                time.sleep(self._poll_s)
                state = self._agent.check_xfer_state(xfer)
            return None if state == "DONE" else "NIXL reported a transfer error"
        finally:
            self._quietly(xfer.release)  # in progress: NIXL cancels it (see the module docstring)

    def _fence(self, peer: _Peer) -> bool:
        """True once every earlier operation towards ``peer`` completed or was discarded."""
        deadline = time.monotonic() + self._drain_timeout_s
        try:
            xfer = self._agent.make_prepped_xfer(
                "READ", peer.local, [self._num_blocks], peer.remote, [peer.num_blocks]
            )
            try:
                state = self._agent.transfer(xfer)
                while state == "PROC" and time.monotonic() < deadline:
                    time.sleep(self._poll_s)
                    state = self._agent.check_xfer_state(xfer)
                return state == "DONE"
            finally:
                self._quietly(xfer.release)
        except Exception as e:
            logger.warning("NIXL fence towards %s failed: %s: %s", peer.agent, type(e).__name__, e)
            return False

    @staticmethod
    def _quietly(action: Any) -> None:
        try:
            action()
        except Exception as e:  # cleanup after a failure: the failure itself is already recorded
            logger.debug("NIXL cleanup step failed: %s: %s", type(e).__name__, e)
