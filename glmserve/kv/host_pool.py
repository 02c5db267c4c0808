"""HostBlockPool: the host (CPU) tier's block bookkeeping: hash -> block, leases, LRU eviction.

Plain Python, no I/O: the kvstore service owns the bytes (one registered CPU buffer, one row per
block) and moves them with the transfer backend; this class decides which rows.

Every block ``0..num_blocks-1`` is in exactly one place:

- free: no hash, no lease;
- writing: reserved for one write lease under a hash that is NOT visible yet (a writer's bytes are
  landing in it); it becomes stored on ``commit_write``, or free on ``abort_write``;
- stored: holds a committed hash (visible to ``match`` and ``begin_read``); with no reader it sits
  in the LRU (least recently used first), with readers it is pinned.

LayerSplit stages write their slices of one whole-model block separately: a write lease with a
``part`` (stage, stages) reserves the block (or joins the block another stage of the same split
reserved for that hash), and the block becomes stored only once every stage's part committed. A
block some parts committed but not all stays writing until ``lease_timeout_s`` after it was
reserved, then ``expire`` frees it.

Eviction (in ``begin_write``, when no block is free) only ever takes stored blocks with no reader:
blocks being written or read are never touched. Leases carry a deadline: ``expire(now)`` ends
those past it (the timeout backstop for a worker that died mid-transfer; pick it longer than the
transfer timeout plus drain, the timeout both sides agree on). Keys are the chained block hashes,
so the model revision, tokenizer, layout and tenant salt are part of every key.

Not thread-safe: the service holds one lock around it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from glmserve.kv.block_pool import IntegrityError
from glmserve.kv.transfer.stamp import TransferStamp
from glmserve.kv.transfer.timeouts import AGREED


def write_stamp(lease_id: int) -> TransferStamp:
    """The stamp a worker writes a write lease's blocks with (the kvstore waits for its completion)."""
    return TransferStamp(f"host-write-{lease_id}", 0)


@dataclass
class WriteLease:
    """Blocks reserved for one write. ``hashes[i]`` lands in ``block_ids[i]``; ``evicted``: hashes
    this reservation pushed out of the tier (the index must drop them)."""

    lease_id: int
    hashes: list[bytes]
    block_ids: list[int]
    deadline: float
    evicted: list[bytes] = field(default_factory=list)
    part: tuple[int, int] | None = None  # (stage, stages): a LayerSplit stage's slice of each block


@dataclass
class _Parted:
    """A block whose slices LayerSplit stages write separately."""

    block_id: int
    stages: int
    deadline: float
    committed: set[int] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)  # live leases writing a part of it


@dataclass
class ReadLease:
    """Stored blocks pinned for one read: ``block_ids[i]`` holds ``hashes[i]``."""

    lease_id: int
    hashes: list[bytes]
    block_ids: list[int]
    deadline: float


@dataclass(frozen=True)
class Expired:
    """What ``expire`` ended: read leases unpinned, write leases freed (their blocks lost)."""

    reads: list[int]
    writes: list[int]


class HostBlockPool:
    """See the module docstring. ``lease_timeout_s``: how long a lease may live."""

    def __init__(self, num_blocks: int, lease_timeout_s: float = AGREED.lease_s) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks: must be an int >= 0, got {num_blocks!r}")
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s: must be > 0, got {lease_timeout_s!r}")
        self.num_blocks = num_blocks
        self.lease_timeout_s = lease_timeout_s
        self._free: deque[int] = deque(range(num_blocks))
        self._hash: list[bytes | None] = [None] * num_blocks
        self._readers = [0] * num_blocks
        self._stored: dict[bytes, int] = {}  # visible hashes
        self._writing: dict[bytes, int] = {}  # hashes whose bytes are landing
        self._parted: dict[bytes, _Parted] = {}  # those of them written in parts
        self._lru: OrderedDict[int, None] = OrderedDict()  # stored, no reader
        self._writes: dict[int, WriteLease] = {}
        self._reads: dict[int, ReadLease] = {}
        self._ids = itertools.count(1)
        self.evictions = 0

    # -- counters ---------------------------------------------------------------------------------

    @property
    def num_stored(self) -> int:
        return len(self._stored)

    @property
    def num_free(self) -> int:
        """Blocks a write could take now: free plus evictable."""
        return len(self._free) + len(self._lru)

    @property
    def num_pinned(self) -> int:
        """Blocks a lease holds (being written, or read)."""
        return len(self._writing) + sum(1 for r in self._readers if r > 0)

    def stored_hashes(self) -> list[bytes]:
        """Every visible hash, in the order they were stored."""
        return list(self._stored)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._stored

    def is_live(self, lease_id: int) -> bool:
        """Whether a read or write lease is still held (not ended, not expired)."""
        return lease_id in self._reads or lease_id in self._writes

    def match(self, hashes: Sequence[bytes]) -> int:
        """Length of the leading run of ``hashes`` stored here."""
        n = 0
        for block_hash in hashes:
            if block_hash not in self._stored:
                break
            n += 1
        return n

    # -- writes -----------------------------------------------------------------------------------

    def begin_write(self, hashes: Sequence[bytes], now: float, part: tuple[int, int] | None = None) -> WriteLease:
        """Reserve blocks for the hashes not stored or being written yet, in the given order, as
        many as free or evictable blocks allow (the rest are left out). Stored hashes among them
        count as used (moved to the MRU end) so a write-through keeps them alive. With ``part``
        (stage, stages) the lease writes that stage's slice, joining blocks other stages reserved."""
        if part is not None and not 0 <= part[0] < part[1]:
            raise ValueError(f"part: stage {part[0]} of {part[1]}")
        lease = WriteLease(next(self._ids), [], [], now + self.lease_timeout_s, part=part)
        for block_hash in hashes:
            if not isinstance(block_hash, bytes) or not block_hash:
                raise ValueError("hashes: every block hash must be non-empty bytes")
        for block_hash in dict.fromkeys(hashes):  # a hash twice in one call is written once
            stored = self._stored.get(block_hash)
            if stored is not None:
                if stored in self._lru:
                    self._lru.move_to_end(stored)
                continue
            if block_hash in self._writing:
                self._join(lease, block_hash)
                continue
            block_id = self._take(lease.evicted)
            if block_id is None:
                break
            self._hash[block_id] = block_hash
            self._writing[block_hash] = block_id
            if part is not None:
                self._parted[block_hash] = _Parted(block_id, part[1], lease.deadline, leases={lease.lease_id})
            lease.hashes.append(block_hash)
            lease.block_ids.append(block_id)
        self._writes[lease.lease_id] = lease
        return lease

    def _join(self, lease: WriteLease, block_hash: bytes) -> None:
        """Add another stage's part of a block being written in parts (nothing otherwise)."""
        parted = self._parted.get(block_hash)
        if lease.part is None or parted is None or parted.stages != lease.part[1]:
            return
        stage = lease.part[0]
        if stage in parted.committed or any(self._writes[i].part == lease.part for i in parted.leases):
            return
        parted.leases.add(lease.lease_id)
        lease.hashes.append(block_hash)
        lease.block_ids.append(parted.block_id)

    def _take(self, evicted: list[bytes]) -> int | None:
        if self._free:
            return self._free.popleft()
        if not self._lru:
            return None
        block_id, _ = self._lru.popitem(last=False)
        block_hash = self._hash[block_id]
        assert block_hash is not None
        del self._stored[block_hash]
        self._hash[block_id] = None
        evicted.append(block_hash)
        self.evictions += 1
        return block_id

    def commit_write(self, lease_id: int) -> list[bytes]:
        """The lease's bytes all landed: its hashes become visible (most recently used, in order),
        a block written in parts once its last part is here. Returns the hashes now stored.
        KeyError if the lease is unknown (expired, or never granted)."""
        lease = self._writes.pop(lease_id)
        done = []
        for block_hash, block_id in zip(lease.hashes, lease.block_ids, strict=True):
            parted = self._parted.get(block_hash)
            if parted is not None:
                parted.leases.discard(lease_id)
                assert lease.part is not None
                parted.committed.add(lease.part[0])
                if len(parted.committed) < parted.stages:
                    continue
                del self._parted[block_hash]
            del self._writing[block_hash]
            self._stored[block_hash] = block_id
            self._lru[block_id] = None
            done.append(block_hash)
        return done

    def abort_write(self, lease_id: int) -> None:
        """Give the lease's blocks back. Only once no more bytes can land in them (drained). A block
        other stages' parts were committed to waits for its deadline (a later write may finish it)."""
        lease = self._writes.pop(lease_id)
        for block_hash, block_id in zip(lease.hashes, lease.block_ids, strict=True):
            parted = self._parted.get(block_hash)
            if parted is not None:
                parted.leases.discard(lease_id)
                if parted.leases or parted.committed:
                    continue
                del self._parted[block_hash]
            self._free_writing(block_hash, block_id)

    def _free_writing(self, block_hash: bytes, block_id: int) -> None:
        del self._writing[block_hash]
        self._hash[block_id] = None
        self._free.append(block_id)

    # -- reads ------------------------------------------------------------------------------------

    def begin_read(self, hashes: Sequence[bytes], now: float) -> ReadLease:
        """Pin the leading run of ``hashes`` that is stored (possibly empty) until ``end_read``."""
        lease = ReadLease(next(self._ids), [], [], now + self.lease_timeout_s)
        for block_hash in hashes:
            block_id = self._stored.get(block_hash)
            if block_id is None:
                break
            if self._readers[block_id] == 0:
                del self._lru[block_id]
            self._readers[block_id] += 1
            lease.hashes.append(block_hash)
            lease.block_ids.append(block_id)
        self._reads[lease.lease_id] = lease
        return lease

    def end_read(self, lease_id: int) -> None:
        """Unpin a read lease's blocks (most recently used: they were just read). KeyError if unknown."""
        lease = self._reads.pop(lease_id)
        for block_id in lease.block_ids:
            self._readers[block_id] -= 1
            if self._readers[block_id] == 0:
                self._lru[block_id] = None

    # -- the backstop -----------------------------------------------------------------------------

    def expire(self, now: float) -> Expired:
        """End every lease whose deadline passed: reads are unpinned, writes freed."""
        reads = [i for i, lease in self._reads.items() if lease.deadline <= now]
        writes = [i for i, lease in self._writes.items() if lease.deadline <= now]
        for lease_id in reads:
            self.end_read(lease_id)
        for lease_id in writes:
            self.abort_write(lease_id)
        for block_hash, parted in list(self._parted.items()):  # parts that never all came
            if parted.deadline <= now and not parted.leases:
                del self._parted[block_hash]
                self._free_writing(block_hash, parted.block_id)
        return Expired(reads, writes)

    # -- checks -----------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless every invariant holds. O(num_blocks)."""

        def fail(message: str) -> None:
            raise IntegrityError(message)

        place: dict[int, str] = {}
        for name, ids in (("free", list(self._free)), ("writing", list(self._writing.values())),
                          ("stored", list(self._stored.values()))):
            for block_id in ids:
                if block_id in place:
                    fail(f"block {block_id} is {name} and {place[block_id]}")
                place[block_id] = name
        if len(place) != self.num_blocks:
            fail(f"{len(place)} blocks accounted for, pool has {self.num_blocks}")
        for block_hash, block_id in [*self._stored.items(), *self._writing.items()]:
            if self._hash[block_id] != block_hash:
                fail(f"block {block_id} holds another hash than its map entry")
        for block_id in self._free:
            if self._hash[block_id] is not None or self._readers[block_id]:
                fail(f"free block {block_id} has a hash or readers")
        pins = [0] * self.num_blocks
        for lease in self._reads.values():
            for block_id in lease.block_ids:
                pins[block_id] += 1
        if pins != self._readers:
            fail("reader counts do not match the read leases")
        for block_id in self._stored.values():
            if (self._readers[block_id] == 0) != (block_id in self._lru):
                fail(f"stored block {block_id}: in LRU iff it has no reader")
        if len(self._lru) > len(self._stored):
            fail("LRU holds blocks that are not stored")
        leased = {b for lease in self._writes.values() for b in lease.block_ids}
        leased |= {p.block_id for p in self._parted.values()}
        if leased != set(self._writing.values()):
            fail("blocks being written do not match the write leases")
        for block_hash, parted in self._parted.items():
            if self._writing.get(block_hash) != parted.block_id or len(parted.committed) >= parted.stages:
                fail(f"block {parted.block_id} written in parts is not writing or is complete")
