"""BlockIndex: the cluster's map from KV block hash to the workers, and tiers, that hold the block.

Contract (every implementation keeps it; callers may use any of them interchangeably):

``stored(worker, tier, hashes)``
    ``worker`` now holds these blocks on ``tier``. Idempotent. Hashes come in chain order.
``removed(worker, tier, hashes)``
    ``worker`` no longer holds these blocks on ``tier``; entries the index does not have are ignored.
``remove_worker(worker) -> int``
    Forget every block ``worker`` held, on every tier (it died or left); returns the entries dropped.
``match(hashes) -> dict[str, PrefixMatch]``
    ``hashes`` are a prompt's block hashes in prompt order. For each worker, the length of the
    longest leading run of them it holds on the device tier and, separately, on the host tier.
    The stages of a LayerSplit replica publish under ``stage_worker_id(replica, k, n)``; each
    holds its slice of a block, so the replica holds a block only when all ``n`` stages do, and it
    is matched under the replica's id.
    Workers with no leading block on either tier are left out; keys are sorted. The walk stops as
    soon as no worker still holds an unbroken run, so its cost follows the matched prefix, not
    the prompt length. Leading runs, not counts: a chain hash pins its whole prefix, but a worker
    may have evicted an earlier block and kept a later one, and only a leading run is reusable.
``block_counts() -> dict[Tier, int]``
    (worker, block) entries per tier: the block copies the cluster holds (for metrics).
``healthy() -> bool``
    Whether the backend can be reached now; never raises.
``epoch() -> str``
    An id that changes whenever entries may have been lost (a new in-memory index, a Redis that
    restarted); empty while the backend cannot be reached; never raises. Publishers seeing a new
    epoch publish everything they hold again, so the index is rebuilt.
``close()``
    Releases connections; the index is unusable afterwards.

Errors: ``ValueError`` (naming the argument) for an empty worker id, an empty hash or an unknown
tier; ``IndexUnavailable`` when the backend cannot be reached, raised within a bounded time (short
socket timeouts), never a hang. Implementations are thread-safe (gRPC handler threads share one).

Hashes are opaque bytes (the chain hashes of ``glmserve.core.block_hash``). Implementations:
`InMemoryBlockIndex` here; ``RedisBlockIndex`` (shared by several kvstore replicas) in
``glmserve.services.kvstore.redis_index``, the only place that talks to Redis.
"""

from __future__ import annotations

import re
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from glmserve.core.errors import GlmServeError


class Tier(StrEnum):
    DEVICE = "device"  # a worker's own block pool
    HOST = "host"  # the host (CPU) tier


Holder = tuple[str, Tier]
"""(worker id, tier): one copy of a block."""


class IndexUnavailable(GlmServeError):
    """The index backend (Redis) cannot be reached; the caller should fall back, not wait."""


@dataclass(frozen=True)
class PrefixMatch:
    """Leading blocks of a prompt one worker holds, per tier."""

    device_blocks: int = 0
    host_blocks: int = 0


def check_event(worker: str, tier: Tier | str, hashes: Iterable[bytes]) -> tuple[str, Tier, list[bytes]]:
    """Validates one event's arguments; returns them normalized (``Tier`` member, list of hashes)."""
    if not isinstance(worker, str) or not worker:
        raise ValueError(f"worker: must be a non-empty string, got {worker!r}")
    try:
        tier = Tier(tier)
    except ValueError:
        raise ValueError(f"tier: must be one of {[t.value for t in Tier]}, got {tier!r}") from None
    hashes = list(hashes)
    if any(not isinstance(h, bytes) or not h for h in hashes):
        raise ValueError("hashes: every block hash must be non-empty bytes")
    return worker, tier, hashes


_STAGE_ID = re.compile(r"^(?P<replica>.+)#stage(?P<stage>\d+)/(?P<stages>\d+)$")


def stage_worker_id(replica: str, stage: int, num_stages: int) -> str:
    """The index holder id of stage ``stage`` of a LayerSplit replica (a whole prefill worker when
    ``num_stages`` is 1, so a one-stage replica publishes under the replica's own id)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage: {stage} is not a stage of {num_stages}")
    return replica if num_stages == 1 else f"{replica}#stage{stage}/{num_stages}"


def _holding(holders: Iterable[Holder]) -> dict[Tier, set[str]]:
    """Per tier, the workers (and the replicas all of whose stages) that hold one block."""
    here: dict[Tier, set[str]] = {Tier.DEVICE: set(), Tier.HOST: set()}
    stages: dict[tuple[Tier, str, int], set[int]] = {}
    for worker, tier in holders:
        staged = _STAGE_ID.match(worker)
        if staged is None:
            here[tier].add(worker)
            continue
        key = (tier, staged["replica"], int(staged["stages"]))
        stages.setdefault(key, set()).add(int(staged["stage"]))
    for (tier, replica, n), held in stages.items():
        if len(held) == n:
            here[tier].add(replica)
    return here


def longest_runs(holders_per_block: Iterable[Iterable[Holder]]) -> dict[str, PrefixMatch]:
    """The ``match`` walk over the holders of each prompt block, in order. Consumes the iterable
    lazily and stops once no worker still holds an unbroken run on any tier."""
    runs: dict[Tier, dict[str, int]] = {Tier.DEVICE: {}, Tier.HOST: {}}
    alive: dict[Tier, set[str]] | None = None  # workers whose run is unbroken so far, per tier
    for i, holders in enumerate(holders_per_block):
        here = _holding(holders)
        alive = here if alive is None else {t: alive[t] & here[t] for t in Tier}
        if not any(alive.values()):
            break
        for tier, workers in alive.items():
            for worker in workers:
                runs[tier][worker] = i + 1
    workers = sorted(runs[Tier.DEVICE].keys() | runs[Tier.HOST].keys())
    return {w: PrefixMatch(runs[Tier.DEVICE].get(w, 0), runs[Tier.HOST].get(w, 0)) for w in workers}


class BlockIndex(ABC):
    """See the module docstring for the contract."""

    backend: ClassVar[str]

    @abstractmethod
    def stored(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None: ...

    @abstractmethod
    def removed(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None: ...

    @abstractmethod
    def remove_worker(self, worker: str) -> int: ...

    @abstractmethod
    def match(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]: ...

    @abstractmethod
    def block_counts(self) -> dict[Tier, int]: ...

    @abstractmethod
    def healthy(self) -> bool: ...

    @abstractmethod
    def epoch(self) -> str: ...

    def describe(self) -> str:
        """Where the index lives, for logs (no secrets)."""
        return self.backend

    def close(self) -> None:  # noqa: B027 -- optional hook; the in-memory index holds nothing
        """Releases connections."""


class InMemoryBlockIndex(BlockIndex):
    """The index in this process: hash -> holders, plus worker -> tier -> hashes so that
    ``remove_worker`` costs what the worker held. ``match`` is one dict lookup per matched block."""

    backend = "memory"

    def __init__(self) -> None:
        self._holders: dict[bytes, set[Holder]] = {}
        self._by_worker: dict[str, dict[Tier, set[bytes]]] = {}
        self._lock = threading.Lock()
        self._epoch = uuid.uuid4().hex  # the entries live and die with this object

    def epoch(self) -> str:
        return self._epoch

    def stored(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        worker, tier, hashes = check_event(worker, tier, hashes)
        with self._lock:
            held = self._by_worker.setdefault(worker, {Tier.DEVICE: set(), Tier.HOST: set()})[tier]
            for h in hashes:
                self._holders.setdefault(h, set()).add((worker, tier))
                held.add(h)

    def removed(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        worker, tier, hashes = check_event(worker, tier, hashes)
        with self._lock:
            held = self._by_worker.get(worker, {}).get(tier, set())
            for h in hashes:
                self._drop(h, (worker, tier))
                held.discard(h)

    def remove_worker(self, worker: str) -> int:
        worker, _, _ = check_event(worker, Tier.DEVICE, ())
        with self._lock:
            tiers = self._by_worker.pop(worker, {})
            for tier, hashes in tiers.items():
                for h in hashes:
                    self._drop(h, (worker, tier))
            return sum(len(hashes) for hashes in tiers.values())

    def match(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]:
        with self._lock:
            # A generator would hold the lock across the walk anyway; the walk stops early.
            return longest_runs(self._holders.get(h, ()) for h in hashes)

    def block_counts(self) -> dict[Tier, int]:
        with self._lock:
            return {t: sum(len(tiers[t]) for tiers in self._by_worker.values()) for t in Tier}

    def healthy(self) -> bool:
        return True

    def _drop(self, h: bytes, holder: Holder) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(holder)
            if not holders:  # keep the map's size bounded by what is held
                del self._holders[h]
