"""Records the kvstore keeps for clients (``PutRecord`` / ``GetRecord`` / ``DeleteRecord``): bytes under (namespace,
key) until a TTL passes. The router keeps stored Responses here so every replica reads the same
ones. `MemoryRecords`: in this process, bounded (`ExpiringMap`); `RedisRecords`: in the Redis the
index uses (``<prefix>:rec:<namespace>:<key>`` with Redis's own expiry), shared by every kvstore
pointing at it. Both raise ``ValueError`` naming the field for a bad request and
``IndexUnavailable`` while Redis cannot be reached.
"""

from __future__ import annotations

import threading
from typing import Protocol

from glmserve.core.expiring_map import ExpiringMap
from glmserve.kv.block_index import IndexUnavailable

MAX_NAME_CHARS = 256


def check_name(namespace: str, key: str) -> None:
    for field, value in (("namespace", namespace), ("key", key)):
        if not value or len(value) > MAX_NAME_CHARS:
            raise ValueError(f"{field}: must be 1-{MAX_NAME_CHARS} characters")


def check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")


class Records(Protocol):
    def put(self, namespace: str, key: str, value: bytes, ttl_s: float) -> bool: ...

    def get(self, namespace: str, key: str) -> bytes | None: ...

    def delete(self, namespace: str, key: str) -> bool: ...


class MemoryRecords:
    """Records in this process; thread-safe (the gRPC server calls from its handler threads)."""

    def __init__(self, max_entries: int = 100_000, max_bytes: int = 512 << 20) -> None:
        self._map = ExpiringMap(max_entries, max_bytes)
        self._lock = threading.Lock()

    def put(self, namespace: str, key: str, value: bytes, ttl_s: float) -> bool:
        check_name(namespace, key)
        check_ttl(ttl_s)
        with self._lock:
            return self._map.put(f"{namespace}:{key}", value, ttl_s)

    def get(self, namespace: str, key: str) -> bytes | None:
        check_name(namespace, key)
        with self._lock:
            return self._map.get(f"{namespace}:{key}")

    def delete(self, namespace: str, key: str) -> bool:
        check_name(namespace, key)
        with self._lock:
            return self._map.delete(f"{namespace}:{key}")


class RedisRecords:
    """Records in Redis at ``url`` (short timeouts, as the Redis index has)."""

    def __init__(self, url: str, *, key_prefix: str = "glmserve", timeout_s: float = 0.5,
                 max_value_bytes: int = 64 << 20) -> None:
        import redis  # only this backend needs the redis package
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 1), health_check_interval=0)
        self._prefix, self.max_value_bytes = key_prefix, max_value_bytes

    def put(self, namespace: str, key: str, value: bytes, ttl_s: float) -> bool:
        check_name(namespace, key)
        check_ttl(ttl_s)
        if len(value) > self.max_value_bytes:
            return False
        ttl_ms = max(1, int(ttl_s * 1000))
        try:
            self._redis.set(self._key(namespace, key), value, px=ttl_ms)
        except self._errors as e:
            raise IndexUnavailable(f"redis: {e}") from None
        return True

    def get(self, namespace: str, key: str) -> bytes | None:
        check_name(namespace, key)
        try:
            return self._redis.get(self._key(namespace, key))
        except self._errors as e:
            raise IndexUnavailable(f"redis: {e}") from None

    def delete(self, namespace: str, key: str) -> bool:
        check_name(namespace, key)
        try:
            return bool(self._redis.delete(self._key(namespace, key)))
        except self._errors as e:
            raise IndexUnavailable(f"redis: {e}") from None

    def close(self) -> None:
        self._redis.close()

    def _key(self, namespace: str, key: str) -> str:
        return f"{self._prefix}:rec:{namespace}:{key}"
