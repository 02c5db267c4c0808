"""WorkerHealth: what a prefill or decode worker's Health RPC reports (the router's `HealthReport`
is its view of the same answer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerHealth:
    ready: bool
    running: int
    waiting: int
    free_blocks: int
    cache_root: bytes = b""  # the engine's prefix-cache root hash (empty: caching off); the router hashes with it
    block_size: int = 0
