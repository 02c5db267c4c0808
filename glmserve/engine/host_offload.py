"""HostOffload: the engine's side of the host KV tier (write-through, demotion, load-back).

Plain bookkeeping on the engine thread; the worker moves the bytes (transfer backend + kvstore
RPCs) and reports back. Every block a host transfer reads or writes is owned while it runs
(DESIGN invariant 2):

- write-through: when a request frees its blocks, its committed (hashed, full) blocks get one
  more owner and are handed to ``notify`` as a `HostWrite`; ``write_done`` drops that owner.
  Blocks of generated tokens are committed like prompt blocks, so they go too.
- demotion: when the pool evicts a cached block (``on_evict``, called inside ``allocate`` before
  anyone writes the block), its bytes are first copied into a staging row (extra rows of the cache
  buffer past the pool's blocks, registered with the buffer) and that row is written to the host;
  ``write_done`` frees the row. With no staging row free, the block is dropped as before.
- load-back: ``begin_load`` pins the device hits of a prompt and allocates destination blocks for
  the hashes the host holds; ``commit_load`` hashes the loaded ones, ``end_load`` gives the load's
  ownership back (the request has acquired what it reuses by then). ``cancel_load`` gives
  everything back unhashed: call it only once the load's write is drained.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from glmserve.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from glmserve.engine.kv_cache_manager import KVCacheManager

_KNOWN_LIMIT = 1 << 16  # hashes remembered as already on the host (a hint that saves demotions)


@dataclass(eq=False)
class HostWrite:
    """Rows of the cache buffer to copy to the host tier; ``hashes[i]`` is row ``rows[i]``'s block."""

    rows: list[int]
    hashes: list[bytes]
    kind: str  # "write_through" (rows are pinned device blocks) or "demotion" (staging rows)


@dataclass
class _Load:
    device: list[int]  # device hits pinned by the load
    dest: list[int]  # blocks the host writes into
    hashes: list[bytes] = field(default_factory=list)  # hashes the dest blocks are for


class HostOffload:
    def __init__(self, pool: BlockPool, buffer: torch.Tensor, num_staging: int, *,
                 write_through: bool, notify: Callable[[HostWrite], None],
                 on_drop: Callable[[], None] | None = None) -> None:
        """``buffer`` rows ``pool.num_blocks .. +num_staging`` are the staging rows (0: no demotion).
        ``on_drop``: called for each eviction that could not be demoted (no staging row free)."""
        if buffer.shape[0] < pool.num_blocks + num_staging:
            raise ValueError(f"num_staging: buffer has {buffer.shape[0]} rows, pool needs "
                             f"{pool.num_blocks} + {num_staging}")
        self.pool, self.buffer = pool, buffer
        self.write_through = write_through
        self._notify, self._on_drop = notify, on_drop
        self._staging: deque[int] = deque(range(pool.num_blocks, pool.num_blocks + num_staging))
        self.num_staging = num_staging
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._loads: dict[str, _Load] = {}
        self.demotions_dropped = 0  # evictions with no staging row free

    # -- writes -----------------------------------------------------------------------------------

    def on_free(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> None:
        """A request is about to release its blocks; ``hashes`` are its committed leading blocks."""
        if not self.write_through or not hashes:
            return
        rows = list(block_ids[: len(hashes)])
        self.pool.acquire(rows)
        self._notify(HostWrite(rows, list(hashes), "write_through"))

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """The pool just evicted ``block_id`` (its bytes are intact until its new owner writes)."""
        if not self.num_staging or block_hash in self._known:
            return
        if not self._staging:
            self.demotions_dropped += 1
            if self._on_drop is not None:
                self._on_drop()
            return
        row = self._staging.popleft()
        self.buffer[row].copy_(self.buffer[block_id])
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)  # the transfer reads the row outside torch
        self._notify(HostWrite([row], [block_hash], "demotion"))

    def write_done(self, write: HostWrite, stored: Sequence[bytes]) -> None:
        """The write's transfer is final (and drained): give its rows back. ``stored``: the hashes
        the host tier now holds (remembered, so their eviction needs no demotion)."""
        if write.kind == "write_through":
            self.pool.release(write.rows[::-1])
        else:
            self._staging.extend(write.rows)
        for block_hash in stored:
            self._remember(block_hash)

    def _remember(self, block_hash: bytes) -> None:
        self._known[block_hash] = None
        self._known.move_to_end(block_hash)
        if len(self._known) > _KNOWN_LIMIT:
            self._known.popitem(last=False)

    def forget(self, hashes: Sequence[bytes]) -> None:
        """The host tier no longer holds these (a failed load found them gone)."""
        for block_hash in hashes:
            self._known.pop(block_hash, None)

    # -- loads ------------------------------------------------------------------------------------

    def device_hits(self, hashes: Sequence[bytes]) -> int:
        return len(self.pool.lookup(hashes))

    def begin_load(self, key: str, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """Pin the device run of ``hashes`` and allocate blocks for the rest (as many as are free);
        returns (device blocks, destination blocks for ``hashes[device:]``)."""
        if key in self._loads:
            raise ValueError(f"key: a load for {key!r} is already running")
        device = self.pool.lookup(hashes)
        self.pool.acquire(device)
        want = min(len(hashes) - len(device), self.pool.num_free)
        dest = self.pool.allocate(want)  # may evict (and demote) cached blocks; never the pinned hits
        self._loads[key] = _Load(device, dest, list(hashes[len(device): len(device) + want]))
        return len(device), list(dest)

    def commit_load(self, key: str, num_loaded: int) -> int:
        """Hash the first ``num_loaded`` destination blocks (their bytes landed); returns how many
        are in the prefix cache now (a hash another block already holds stays with that block)."""
        load = self._loads[key]
        committed = 0
        for block_id, block_hash in zip(load.dest[:num_loaded], load.hashes[:num_loaded], strict=True):
            committed += self.pool.commit(block_id, block_hash)
            self._remember(block_hash)
        return committed

    def end_load(self, key: str) -> None:
        """Drop the load's ownership (after the request acquired what it reuses)."""
        load = self._loads.pop(key)
        self.pool.release(load.dest[::-1])
        self.pool.release(load.device[::-1])

    def cancel_load(self, key: str) -> bool:
        """Give a load's blocks back unhashed (its write is drained). False if unknown."""
        if key not in self._loads:
            return False
        self.end_load(key)
        return True

    @property
    def num_loads(self) -> int:
        return len(self._loads)


def attach_host_offload(kv: KVCacheManager, buffer: torch.Tensor, num_staging: int, write_through: bool,
                        notify: Callable[[HostWrite], None], on_drop: Callable[[], None] | None) -> HostOffload:
    """The host tier's engine side over ``kv``'s pool (`Engine` and a LayerSplit stage alike): freed
    blocks are written through or demoted from here on. Needs prefix caching (host blocks are
    found by hash)."""
    if kv.root_hash is None:
        raise ValueError("prefix_caching: the host tier needs prefix caching on")
    host = HostOffload(kv.pool, buffer, num_staging, write_through=write_through, notify=notify, on_drop=on_drop)
    kv.on_free = host.on_free
    return host
