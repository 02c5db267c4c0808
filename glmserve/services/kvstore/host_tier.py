"""HostTier: the kvstore's host (CPU) block tier: one registered CPU buffer, a `HostBlockPool` over
its rows, and the KV transfer backend that moves bytes in and out.

Bytes never pass through gRPC: workers write host rows directly (the kvstore is the transfer
receiver; NIXL or the TCP fallback, same backend code as prefill -> decode), and loads are writes
from here into the worker's registered cache (the kvstore is the writer). gRPC only carries the
control messages (`servicer`).

The buffer is sized at the first ``attach``: ``capacity_bytes // block_bytes`` rows of the worker's
block size; later workers must have the same block size and transfer kind. Rows are whole-model
blocks: a LayerSplit stage attaches with its slice of them (``row_offset``, ``row_bytes``), writes
its slice of each block (a write lease in parts: the block is stored once every stage's slice
landed) and loads back only its slice. Blocks stored or evicted
here are published to the block index under ``holder_id`` with tier HOST (best effort: an index
that is down does not stop the tier).

Ownership: a write lease's rows are the destination of the worker's write; they are given back
only on the worker's ``end_write(committed=False)`` (sent once its write is drained) or when the
lease expires (``lease_timeout_s``, longer than the transfer timeout plus drain). A load pins its
source rows until its write is final.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from glmserve.core.errors import GlmServeError
from glmserve.kv.block_index import BlockIndex, IndexUnavailable, Tier
from glmserve.kv.host_pool import HostBlockPool, WriteLease, write_stamp
from glmserve.kv.transfer import (
    BlockWindow,
    KVTransferBackend,
    TransferDrainError,
    TransferHandle,
    TransferStamp,
)
from glmserve.kv.transfer.timeouts import AGREED

log = logging.getLogger(__name__)


FAULT_DELAY_PREFIX = "fault-delay-"  # loads of such request ids wait ``fault_load_delay_s`` (tests)


class HostTierUnavailable(GlmServeError):
    """No host tier here, or the worker does not fit it (transfer kind, block size)."""


@dataclass(frozen=True)
class HostTierStats:
    capacity_blocks: int
    block_bytes: int
    stored_blocks: int
    pinned_blocks: int
    evictions: int
    expired_leases: int


@dataclass(eq=False)
class _Load:
    cancelled: threading.Event = field(default_factory=threading.Event)
    handle: TransferHandle | None = None


@dataclass(frozen=True)
class LoadResult:
    blocks_loaded: int
    drained: bool
    error: str = ""


class HostTier:
    def __init__(self, capacity_bytes: int, backend: KVTransferBackend, index: BlockIndex | None = None,
                 *, holder_id: str = "host", lease_timeout_s: float = AGREED.lease_s,
                 completion_timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 check_integrity: bool = False, fault_load_delay_s: float = 0.0) -> None:
        """``check_integrity``: check the pool after every operation (tests). ``fault_load_delay_s``:
        loads whose request id starts with ``FAULT_DELAY_PREFIX`` wait this long, or until cancelled,
        before they write (fault injection for tests; 0 in production)."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {capacity_bytes}")
        if not holder_id:
            raise ValueError("holder_id: must not be empty")
        self.capacity_bytes, self.holder_id = capacity_bytes, holder_id
        self.backend, self._index = backend, index
        self._lease_timeout_s, self._completion_timeout_s = lease_timeout_s, completion_timeout_s
        self._clock = clock
        self._check, self._fault_load_delay_s = check_integrity, fault_load_delay_s
        self._lock = threading.Lock()  # the pool, the targets, the loads
        self._completion_lock = threading.Lock()
        self._completed: set[str] = set()
        self._pool: HostBlockPool | None = None
        self._buffer: torch.Tensor | None = None
        self._block_bytes = 0
        self._expired = 0
        self._targets: dict[str, tuple[bytes, BlockWindow | None]] = {}  # where, and which bytes, loads go
        self._peers: dict[tuple[bytes, BlockWindow | None], str] = {}
        self._loads: dict[tuple[str, int], _Load] = {}
        self._index_epoch: str | None = None  # the index epoch our blocks were last published to
        self._index_dirty = False  # an event of ours was dropped
        self._publish_lock = threading.Lock()  # our index writes, in order

    # -- setup --------------------------------------------------------------------------------------

    def attach(self, worker_id: str, transfer_kind: str, block_bytes: int, target_info: bytes, *,
               row_offset: int = 0, row_bytes: int = 0) -> tuple[bytes, int]:
        """Register a worker; sizes the buffer on the first call. Returns (our target, num blocks).
        ``row_offset``/``row_bytes`` (0: whole blocks): a stage whose blocks are that slice of rows."""
        if not worker_id:
            raise ValueError("worker_id: must not be empty")
        if transfer_kind != self.backend.kind:
            raise HostTierUnavailable(f"transfer_kind: host tier uses {self.backend.kind!r}, worker {transfer_kind!r}")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes: must be > 0, got {block_bytes}")
        row_bytes = row_bytes or block_bytes
        if row_offset + block_bytes > row_bytes:
            raise ValueError(f"row_offset: {row_offset} + {block_bytes} B exceeds blocks of {row_bytes} B")
        with self._lock:
            if self._pool is None:
                num_blocks = self.capacity_bytes // row_bytes
                if num_blocks < 1:
                    raise HostTierUnavailable(f"block_bytes: {row_bytes} B exceeds the host tier capacity")
                self._buffer = torch.zeros(num_blocks, row_bytes, dtype=torch.uint8)
                self.backend.register(self._buffer)
                self._pool = HostBlockPool(num_blocks, self._lease_timeout_s)
                self._block_bytes = row_bytes
                log.info("host tier: %d blocks of %d B (%.1f MiB), %s transfer", num_blocks, row_bytes,
                         num_blocks * row_bytes / 2**20, self.backend.kind)
            elif row_bytes != self._block_bytes:
                raise HostTierUnavailable(f"block_bytes: host tier blocks are {self._block_bytes} B, got {row_bytes}")
            sliced = row_bytes != block_bytes
            self._targets[worker_id] = (bytes(target_info), BlockWindow(row_offset, 0, block_bytes) if sliced else None)
            return self.backend.target_info(), self._pool.num_blocks

    def _ready_pool(self) -> HostBlockPool:
        if self._pool is None:
            raise HostTierUnavailable("the host tier has no blocks until a worker attaches")
        return self._pool

    # -- lookups and writes -------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> int:
        with self._lock:
            return 0 if self._pool is None else self._pool.match(hashes)

    def begin_write(self, hashes: Sequence[bytes], part: tuple[int, int] | None = None) -> WriteLease:
        """``part``: (stage, stages) of a LayerSplit stage writing its slices (`HostBlockPool`)."""
        with self._lock:
            self._expire_locked()
            lease = self._ready_pool().begin_write(hashes, self._clock(), part)
            self._checked()
            self.backend.expect_writes(1)  # until the lease ends (here or by expiry)
        self._publish("removed", lease.evicted)
        return lease

    def end_write(self, lease_id: int, committed: bool) -> int:
        """Commit (once the write's completion stamp is here) or give back a lease; stored count.
        KeyError: the lease is unknown (expired); TimeoutError: committed but no completion came."""
        with self._lock:
            if not self._ready_pool().is_live(lease_id):
                raise KeyError(f"write lease {lease_id}")
        if committed:
            self._await_completion(write_stamp(lease_id).request_id)
        with self._lock:
            pool = self._ready_pool()
            if committed:
                hashes = pool.commit_write(lease_id)
            else:
                pool.abort_write(lease_id)
                hashes = []
            self._checked()
            self.backend.expect_writes(-1)
        self._publish("stored", hashes)
        return len(hashes)

    def _await_completion(self, request_id: str) -> None:
        deadline = time.monotonic() + self._completion_timeout_s
        while True:
            with self._completion_lock:
                for stamp in self.backend.completions():
                    self._completed.add(stamp.request_id)
                if request_id in self._completed:
                    self._completed.discard(request_id)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{request_id}: no completion within {self._completion_timeout_s}s")
            time.sleep(0.0005)

    # -- loads --------------------------------------------------------------------------------------

    def load(self, worker_id: str, request_id: str, generation: int, hashes: Sequence[bytes],
             dest_block_ids: Sequence[int]) -> LoadResult:
        """Write the leading stored run of ``hashes`` into the worker's ``dest_block_ids``; returns
        when the write is final. The source rows stay pinned until then."""
        if len(hashes) != len(dest_block_ids):
            raise ValueError(f"dest_block_ids: {len(dest_block_ids)} for {len(hashes)} hashes")
        key = (request_id, generation)
        with self._lock:
            target = self._targets.get(worker_id)
            if target is None:
                raise HostTierUnavailable(f"worker_id: {worker_id!r} has not attached")
            if key in self._loads:
                raise ValueError(f"request_id: a load for {request_id!r}@{generation} is running")
            lease = self._ready_pool().begin_read(hashes, self._clock())
            load = self._loads[key] = _Load()
            self._checked()
        try:
            if not lease.block_ids:
                return LoadResult(0, True)
            if self._fault_load_delay_s and request_id.startswith(FAULT_DELAY_PREFIX):
                load.cancelled.wait(self._fault_load_delay_s)  # test-only: a slow load to cancel
            peer = self._connect(*target)
            dest = list(dest_block_ids[: len(lease.block_ids)])
            with self._lock:  # a cancel either sees the handle or is seen here: never neither
                if load.cancelled.is_set():
                    return LoadResult(0, True, "cancelled")
                load.handle = handle = self.backend.write(peer, TransferStamp(request_id, generation),
                                                          lease.block_ids, dest)
            handle.wait()
            if handle.state == "done":
                return LoadResult(len(dest), True)
            return LoadResult(0, handle.drained, handle.error or "failed")
        finally:
            with self._lock:
                self._loads.pop(key, None)
                if self._pool is not None and self._pool.is_live(lease.lease_id):
                    self._pool.end_read(lease.lease_id)
                self._checked()

    def _connect(self, target: bytes, window: BlockWindow | None) -> str:
        peer = self._peers.get((target, window))
        if peer is None:
            peer = self._peers[(target, window)] = self.backend.connect(target, window)
        return peer

    def cancel_load(self, request_id: str, generation: int) -> tuple[bool, bool]:
        """(found, drained) for a running load; an unknown load is (False, True)."""
        with self._lock:
            load = self._loads.get((request_id, generation))
            if load is None:
                return False, True
            load.cancelled.set()
            handle = load.handle
        if handle is None:  # the load sees the flag before it writes anything
            return True, True
        try:
            self.backend.cancel(handle)
        except TransferDrainError as e:
            log.warning("host load %s@%d: %s", request_id, generation, e)
            return True, False
        return True, True

    # -- upkeep -------------------------------------------------------------------------------------

    def expire(self) -> None:
        with self._lock:
            self._expire_locked()

    def _expire_locked(self) -> None:
        if self._pool is not None:
            done = self._pool.expire(self._clock())
            self._expired += len(done.reads) + len(done.writes)
            if done.writes:
                self.backend.expect_writes(-len(done.writes))
            self._checked()

    def _checked(self) -> None:
        """Under the lock: the integrity check, when asked for (an IntegrityError fails the RPC)."""
        if self._check and self._pool is not None:
            self._pool.check_integrity()

    def stats(self) -> HostTierStats | None:
        with self._lock:
            pool = self._pool
            if pool is None:
                return None
            return HostTierStats(pool.num_blocks, self._block_bytes, pool.num_stored, pool.num_pinned,
                                 pool.evictions, self._expired)

    def check_integrity(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.check_integrity()

    def _publish(self, kind: str, hashes: list[bytes]) -> None:
        if not hashes or self._index is None:
            return
        try:
            with self._publish_lock:
                (self._index.stored if kind == "stored" else self._index.removed)(self.holder_id, Tier.HOST, hashes)
        except IndexUnavailable as e:  # the tier keeps working; `sync_index` republishes later
            self._index_dirty = True
            log.warning("host tier: block index unavailable (%s); %d %s events dropped", e, len(hashes), kind)

    def sync_index(self) -> bool:
        """Publish every stored block again when the index lost entries (its epoch changed: Redis
        restarted) or dropped our events, and at the first call (stale entries of a previous
        kvstore under our holder id go). Called from the kvstore's loop; True when it republished."""
        if self._index is None:
            return False
        epoch = self._index.epoch()
        if not epoch or (epoch == self._index_epoch and not self._index_dirty):
            return False
        try:
            with self._publish_lock:  # no event of ours lands between the snapshot and the rewrite
                with self._lock:
                    hashes = self._pool.stored_hashes() if self._pool is not None else []
                self._index.remove_worker(self.holder_id)
                if hashes:
                    self._index.stored(self.holder_id, Tier.HOST, hashes)
        except IndexUnavailable:
            return False
        if self._index_epoch is not None:
            log.info("host tier: republished %d blocks to the block index", len(hashes))
        self._index_epoch, self._index_dirty = epoch, False
        return True

    def close(self) -> None:
        self.backend.close()
