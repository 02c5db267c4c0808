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
``close()``
    Releases connections; the index is unusable afterwards.

Errors: ``ValueError`` (naming the argument) for an empty worker id, an empty hash or an unknown
tier; ``IndexUnavailable`` when the backend cannot be reached, raised within a bounded time (short
socket timeouts), never a hang. Implementations are thread-safe (gRPC handler threads share one).

Hashes are opaque bytes (the chain hashes of ``glmserve.core.block_hash``).
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, TypeVar
from urllib.parse import urlsplit, urlunsplit

from glmserve.core.errors import GlmServeError

T = TypeVar("T")


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


def redact_url(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


# Drops a worker atomically: an event racing with it cannot leave a stale holder behind.
# Keys are built in the script, so this needs a single Redis (not Redis Cluster).
_REMOVE_WORKER_LUA = """
local prefix, worker, removed = ARGV[1], ARGV[2], 0
for _, tier in ipairs({'device', 'host'}) do
  local wkey = prefix .. ':wrk:' .. worker .. ':' .. tier
  local member = worker .. '|' .. tier
  for _, hex in ipairs(redis.call('SMEMBERS', wkey)) do
    removed = removed + redis.call('SREM', prefix .. ':blk:' .. hex, member)
  end
  redis.call('DEL', wkey)
end
redis.call('SREM', KEYS[1], worker)
return removed
"""


class RedisBlockIndex(BlockIndex):
    """The index in Redis, shared by every kvstore and router that points at it.

    Layout (``p`` = ``key_prefix``): ``p:blk:<hex hash>`` is a set of ``<worker>|<tier>``
    members; ``p:wrk:<worker>:<tier>`` the set of hex hashes that worker holds on that tier (so
    ``remove_worker`` need not scan); ``p:workers`` the set of worker ids. Events are one
    MULTI/EXEC pipeline each; ``match`` fetches holders in pipelined chunks (32, 64, ... 1024
    blocks) and stops at the first chunk where no run survives.

    Socket timeouts are short and a failed command is retried once, at once (that reconnects a
    pooled connection Redis dropped): an unreachable Redis gives ``IndexUnavailable`` in about
    ``2 * timeout_s``, not a hang.
    """

    backend = "redis"

    def __init__(self, url: str, *, key_prefix: str = "glmserve", timeout_s: float = 0.5,
                 first_chunk: int = 32, max_chunk: int = 1024) -> None:
        import redis  # only this backend needs the redis package
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        if not 1 <= first_chunk <= max_chunk:
            raise ValueError(f"first_chunk: must be in [1, max_chunk={max_chunk}], got {first_chunk}")
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1), health_check_interval=0)
        self._url, self._prefix = url, key_prefix
        self._first_chunk, self._max_chunk = first_chunk, max_chunk
        self._remove_worker_script = self._redis.register_script(_REMOVE_WORKER_LUA)

    def stored(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        worker, tier, hashes = check_event(worker, tier, hashes)
        if hashes:
            self._apply_event(worker, tier, hashes, add=True)

    def removed(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        worker, tier, hashes = check_event(worker, tier, hashes)
        if hashes:
            self._apply_event(worker, tier, hashes, add=False)

    def remove_worker(self, worker: str) -> int:
        worker, _, _ = check_event(worker, Tier.DEVICE, ())
        keys, args = [self._workers_key], [self._prefix, worker]
        return int(self._call(lambda: self._remove_worker_script(keys=keys, args=args)))

    def match(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]:
        return longest_runs(self._holders(list(hashes)))

    def block_counts(self) -> dict[Tier, int]:
        workers = sorted(self._call(lambda: self._redis.smembers(self._workers_key)))
        pipe = self._redis.pipeline(transaction=False)
        for worker in workers:
            for tier in Tier:
                pipe.scard(self._worker_key(worker.decode(), tier))
        sizes = self._call(pipe.execute)
        return {t: sum(sizes[i] for i in range(k, len(sizes), len(Tier))) for k, t in enumerate(Tier)}

    def healthy(self) -> bool:
        try:
            return bool(self._redis.ping())
        except Exception:  # any failure means "not usable now"; the contract says never raise
            return False

    def describe(self) -> str:
        return f"redis {redact_url(self._url)} (prefix {self._prefix!r})"

    def close(self) -> None:
        self._redis.close()

    # -- internals --------------------------------------------------------------------------------

    @property
    def _workers_key(self) -> str:
        return f"{self._prefix}:workers"

    def _block_key(self, h: bytes) -> str:
        return f"{self._prefix}:blk:{h.hex()}"

    def _worker_key(self, worker: str, tier: Tier) -> str:
        return f"{self._prefix}:wrk:{worker}:{tier.value}"

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except self._errors as e:
            raise IndexUnavailable(f"redis at {redact_url(self._url)} unreachable: {e}") from e

    def _apply_event(self, worker: str, tier: Tier, hashes: list[bytes], *, add: bool) -> None:
        member = f"{worker}|{tier.value}"
        pipe = self._redis.pipeline(transaction=True)
        for h in hashes:
            (pipe.sadd if add else pipe.srem)(self._block_key(h), member)
        hexes = [h.hex() for h in hashes]
        if add:
            pipe.sadd(self._worker_key(worker, tier), *hexes)
            pipe.sadd(self._workers_key, worker)
        else:
            pipe.srem(self._worker_key(worker, tier), *hexes)
        self._call(pipe.execute)

    def _holders(self, hashes: list[bytes]) -> Iterator[list[Holder]]:
        """Holders of each block, fetched lazily in growing pipelined chunks."""
        start, size = 0, self._first_chunk
        while start < len(hashes):
            pipe = self._redis.pipeline(transaction=False)
            for h in hashes[start:start + size]:
                pipe.smembers(self._block_key(h))
            for members in self._call(pipe.execute):
                yield [_parse_member(m) for m in members]
            start, size = start + size, min(2 * size, self._max_chunk)


def _parse_member(member: bytes) -> Holder:
    worker, tier = member.decode().rsplit("|", 1)
    return worker, Tier(tier)
