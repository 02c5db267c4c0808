"""RedisBlockIndex: the `BlockIndex` contract (``glmserve.kv.block_index``) over one Redis, so several
kvstore replicas (and routers behind them) share the cluster's block index.

Layout: a set per block hash (``<prefix>:blk:<hex>``) of ``worker|tier`` members, a set per worker
of the blocks it holds (to drop a dead worker at once), and the set of workers. Short socket
timeouts: an unreachable Redis raises ``IndexUnavailable`` within ``timeout_s``, never hangs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from glmserve.kv.block_index import (
    BlockIndex,
    Holder,
    IndexUnavailable,
    PrefixMatch,
    Tier,
    check_event,
    longest_runs,
)

T = TypeVar("T")


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

    def epoch(self) -> str:
        """Redis's ``run_id``: new at every Redis start, when its keys may be gone or restored
        from an older snapshot."""
        try:
            return str(self._redis.info("server")["run_id"])
        except Exception:  # unreachable (or a server without run_id): no epoch now
            return ""

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
