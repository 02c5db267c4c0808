"""LocalPrefixView: the router's own guess of which prefill worker caches which blocks.

When the router sends a prompt to a prefill worker, that worker will (almost surely) cache the
prompt's full blocks. The view records exactly that, per worker, in a bounded LRU, so that while the
kvstore or its Redis is down the router still routes repeats and agent turns to the right worker.
It never sees evictions (only the index does), so it is a guess: bounded by
``max_blocks_per_worker`` (set it near a worker's pool size), oldest first out. Device tier only.
Thread-unsafe; the router's event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from glmserve.kv.block_index import PrefixMatch, Tier, longest_runs


class LocalPrefixView:
    def __init__(self, max_blocks_per_worker: int = 65536) -> None:
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker: must be >= 1, got {max_blocks_per_worker}")
        self.max_blocks = max_blocks_per_worker
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def stored(self, worker: str, hashes: Sequence[bytes]) -> None:
        """``worker`` now caches ``hashes`` (a prompt's blocks, in chain order)."""
        held = self._held.setdefault(worker, OrderedDict())
        for h in hashes:
            held.pop(h, None)
            held[h] = None
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def remove_worker(self, worker: str) -> None:
        self._held.pop(worker, None)

    def match(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]:
        """Like ``BlockIndex.match``: per worker, the leading blocks of ``hashes`` it holds."""
        def holders(h: bytes) -> list[tuple[str, Tier]]:
            return [(w, Tier.DEVICE) for w, held in self._held.items() if h in held]

        return longest_runs(holders(h) for h in hashes)

    def num_blocks(self) -> int:
        return sum(len(held) for held in self._held.values())
