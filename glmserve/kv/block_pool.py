"""BlockPool: the device-tier KV block allocator (ref counts, O(1) free list, lazy LRU eviction).

Every block ``0..num_blocks-1`` is in exactly one of three places:

- free: ref count 0, no hash; in the FIFO free list.
- cached-free: ref count 0, holds a committed hash; in the evictable LRU (least recently used
  first). Its KV is still valid, so a prefix lookup can hand it out again.
- used: ref count > 0 (hashed or not).

``allocate`` takes free blocks first and only then evicts cached-free blocks, oldest first
(lazy eviction: cached KV stays until its memory is actually needed). Every operation is O(1) per
block it touches; nothing scans the pool except ``check_integrity``.

Ref counts are general: any owner (a request, an in-flight transfer, ...) may ``acquire`` a block
it wants kept and ``release`` it when done; a block is reused only once every owner has released it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from glmserve.core.errors import GlmServeError

EvictionCallback = Callable[[int, bytes], None]


class BlockListener(Protocol):
    """Told when a hash enters or leaves the prefix-cache map (e.g. to publish it to the kvstore).

    Called on the pool's owning thread after the pool is consistent, once per hash: ``stored`` from
    a ``commit`` that cached a new hash (chain order, as the engine commits), ``removed`` when
    ``allocate`` evicts a cached block. Must be quick and must not raise (the engine step is waiting)."""

    def block_stored(self, block_hash: bytes) -> None: ...

    def block_removed(self, block_hash: bytes) -> None: ...


class OutOfBlocks(GlmServeError):
    """``allocate`` asked for more blocks than are free or evictable; the pool did not change."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"requested {requested} blocks, only {available} free or evictable")
        self.requested = requested
        self.available = available


class IntegrityError(GlmServeError, AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


class BlockPool:
    """Ref-counted KV blocks with a prefix-cache map from block hash to block id.

    Not thread-safe: one engine loop owns it.
    """

    def __init__(self, num_blocks: int, on_evict: EvictionCallback | None = None) -> None:
        """``on_evict(block_id, block_hash)`` is called, after the pool is consistent again, for
        each cached block that ``allocate`` evicts (so the kvstore index can drop it). It must not
        raise: an exception propagates out of ``allocate`` after the blocks were handed out."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks: must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._on_evict = on_evict
        self.num_evictions = 0  # cached blocks evicted by `allocate`, ever
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # OrderedDict as an O(1) doubly-linked LRU: removal from the middle on acquire.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self._num_used = 0
        self._listeners: list[BlockListener] = []

    def add_listener(self, listener: BlockListener) -> None:
        """Tell ``listener`` about every later stored / removed hash (see ``BlockListener``)."""
        self._listeners.append(listener)

    # -- counters ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus cached-free (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with ref count > 0."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix-cache map, used or cached-free."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[self._check_id(block_id)]

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash block ``block_id`` was committed with, or None."""
        return self._hash[self._check_id(block_id)]

    # -- operations -------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref count 1 and no hash; free-list order, then LRU eviction.

        Raises ``OutOfBlocks`` (changing nothing) when fewer than ``n`` blocks are free or evictable.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: must be an int >= 0, got {n!r}")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        out: list[int] = []
        evicted: list[tuple[int, bytes]] = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                block_hash = self._hash[block_id]
                assert block_hash is not None  # only hashed blocks enter the LRU
                del self._cached[block_hash]
                self._hash[block_id] = None
                evicted.append((block_id, block_hash))
            self._ref[block_id] = 1
            out.append(block_id)
        self._num_used += n
        self.num_evictions += len(evicted)
        if self._on_evict is not None:
            for block_id, block_hash in evicted:
                self._on_evict(block_id, block_hash)
        for listener in self._listeners:
            for _, block_hash in evicted:
                listener.block_removed(block_hash)
        return out

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """Block ids of the longest prefix of ``hashes`` in the cache map; stops at the first miss.

        Ref counts are unchanged: ``acquire`` the result before the next ``allocate``, which may
        otherwise evict the cached-free ones.
        """
        out: list[int] = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add one owner to each block (repeats count twice); a cached-free block leaves the LRU.

        Only used or cached blocks can be acquired (a free block holds nothing: use ``allocate``).
        ValueError, changing nothing, if any id is invalid.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref[block_id] == 0 and self._hash[block_id] is None:
                raise ValueError(f"block_ids: block {block_id} is free; allocate it instead")
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._evictable[block_id]
                self._num_used += 1
            self._ref[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one owner from each block, in the given order.

        At ref count 0 a hashed block becomes cached-free (appended to the LRU as most recently
        used) and an unhashed one returns to the tail of the free list. Because the LRU evicts in
        release order, release a request's blocks in REVERSE order (``release(ids[::-1])``): its
        tail blocks are then evicted before its prefix, which other requests are likelier to share.

        ValueError, changing nothing, if a block would go below zero (a double release).
        """
        drops: dict[int, int] = {}
        for block_id in block_ids:
            self._check_id(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
            if drops[block_id] > self._ref[block_id]:
                raise ValueError(
                    f"block_ids: block {block_id} released more often than acquired "
                    f"(ref count {self._ref[block_id]})"
                )
        for block_id in block_ids:
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._num_used -= 1
                if self._hash[block_id] is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None

    def commit(self, block_id: int, block_hash: bytes) -> bool:
        """Record that used block ``block_id`` holds the full block ``block_hash``; True if cached.

        If another block already holds ``block_hash``, the map keeps that one and this block stays
        unhashed (still usable by its owners, freed normally on release), and False is returned:
        one block per hash keeps the map and the LRU simple. Committing the same hash again to the
        same block is a no-op; a different hash on a hashed block, or a commit to a block nobody
        owns, is a ValueError.
        """
        self._check_id(block_id)
        if not isinstance(block_hash, bytes) or not block_hash:
            raise ValueError(f"block_hash: must be non-empty bytes, got {block_hash!r}")
        if self._ref[block_id] == 0:
            raise ValueError(f"block_id: block {block_id} has no owner; acquire or allocate it first")
        current = self._hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block_hash: block {block_id} already holds a different hash")
            return True
        if block_hash in self._cached:
            return False
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        for listener in self._listeners:
            listener.block_stored(block_hash)
        return True

    # -- checks -----------------------------------------------------------------------------------

    def _check_id(self, block_id: int) -> int:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id: {block_id!r} is not in [0, {self.num_blocks})")
        return block_id

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless every invariant holds. O(num_blocks): tests and debugging."""

        def fail(message: str) -> None:
            raise IntegrityError(message)

        seen: dict[int, str] = {}
        for place, ids in (("free", self._free), ("cached-free", self._evictable)):
            for block_id in ids:
                if block_id in seen:
                    fail(f"block {block_id} is in {place} and in {seen[block_id]}")
                seen[block_id] = place
                if self._ref[block_id] != 0:
                    fail(f"block {block_id} in {place} has ref count {self._ref[block_id]}")
                if (self._hash[block_id] is None) != (place == "free"):
                    fail(f"block {block_id} in {place} has hash {self._hash[block_id]!r}")
        used = 0
        for block_id, ref in enumerate(self._ref):
            if ref < 0:
                fail(f"block {block_id} has ref count {ref}")
            if ref > 0:
                used += 1
                if block_id in seen:
                    fail(f"block {block_id} is used (ref {ref}) and in {seen[block_id]}")
            block_hash = self._hash[block_id]
            if block_hash is not None and self._cached.get(block_hash) != block_id:
                fail(f"block {block_id} holds a hash the cache map does not point back to it")
        if used != self._num_used:
            fail(f"num_used is {self._num_used}, counted {used}")
        if len(seen) + used != self.num_blocks:
            fail(
                f"free {len(self._free)} + cached-free {len(self._evictable)} + used {used} != {self.num_blocks}"
            )
        for block_hash, block_id in self._cached.items():
            if self._hash[block_id] != block_hash:
                fail(f"cache map points {block_hash.hex()} at block {block_id}, which holds another hash")
