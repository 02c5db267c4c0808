"""EngineSnapshot: an engine's counters as the services publish them (Health, metrics).

The `EngineHost` replaces its snapshot after every loop iteration, never mutates it, so any thread
may read it without a lock (Health and the metrics collector read it while a step runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters after the thread's latest loop iteration (immutable)."""

    loaded: bool = False
    running: int = 0
    waiting: int = 0
    held: int = 0  # prefill: finished requests whose blocks wait for their transfer
    reserved: int = 0  # decode: reservations waiting for their KV
    free_blocks: int = 0
    used_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    cache_root: bytes = b""  # prefix-cache root hash (empty: caching off); the router hashes with it
    prompt_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: dict[int, int] = field(default_factory=dict)
    draft_lengths: dict[int, int] = field(default_factory=dict)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        load, stats = engine.load(), engine.stats
        return cls(
            loaded=True,
            running=load.running,
            waiting=load.waiting,
            held=load.held,
            reserved=load.reserved,
            free_blocks=load.free_blocks,
            used_blocks=load.used_blocks,
            total_blocks=load.total_blocks,
            block_size=engine.config.block_size,
            cache_root=engine.cache_root,
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens,
            acceptance_lengths=dict(stats.acceptance_lengths),
            draft_lengths=dict(stats.draft_lengths),
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            preemptions=stats.preemptions,
            evictions=load.evictions,
        )
