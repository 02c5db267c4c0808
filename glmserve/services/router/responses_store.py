"""Where stored Responses live (``store: true``), so ``previous_response_id``,
``GET /v1/responses/{id}`` (and its input items) and ``DELETE`` work on every router replica.

A record is one response, the conversation it ended (chat messages, its output included; the
``instructions`` are not part of it, as in the OpenAI API), the request's own input items (for
``GET /v1/responses/{id}/input_items``; records stored before they were kept have none), and the
tenant (API key digest) it belongs to: another tenant never reads or deletes it.
`MemoryResponseStore` keeps records in this router (one replica, e.g. serve-local);
`KVStoreResponseStore` keeps them in the kvstore service (its memory, or its Redis when it has
one), which every replica reaches. Deleting removes the record (the kvstore's ``DeleteRecord``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from glmserve.core.expiring_map import ExpiringMap
from glmserve.services.kvstore.client import AsyncKVStoreClient, KVStoreError
from glmserve.services.router.errors import service_unavailable

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 7 * 24 * 3600.0  # a stored response outlives any agent session
RECORD_NAMESPACE = "responses"


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]
    tenant: str = ""
    input_items: list[dict[str, Any]] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        record = {"response": self.response, "messages": self.messages, "tenant": self.tenant,
                  "input_items": self.input_items}
        return json.dumps(record, ensure_ascii=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StoredResponse:
        record = json.loads(data)
        return cls(record["response"], record["messages"], record.get("tenant", ""),
                   record.get("input_items", []))


class ResponseStore(Protocol):
    async def put(self, record: StoredResponse) -> None:
        """Keep ``record`` under its response's id (a failure is logged: the answer is already made)."""

    async def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None when unknown or expired; 503 when the store cannot answer."""

    async def delete(self, response_id: str) -> bool:
        """Forget the record; False when it was unknown or expired; 503 when the store cannot
        answer."""

    async def close(self) -> None:
        """Let go of connections (the app's lifespan ends)."""


class MemoryResponseStore:
    """Records in this process (bounded; they expire ``ttl_s`` after they were stored)."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = 10_000, max_bytes: int = 256 << 20) -> None:
        self.ttl_s = ttl_s
        self._records = ExpiringMap(max_entries, max_bytes)

    async def put(self, record: StoredResponse) -> None:
        if not self._records.put(record.response["id"], record.to_bytes(), self.ttl_s):
            log.warning("response %s not stored: larger than the store", record.response["id"])

    async def get(self, response_id: str) -> StoredResponse | None:
        data = self._records.get(response_id)
        return StoredResponse.from_bytes(data) if data is not None else None

    async def delete(self, response_id: str) -> bool:
        return self._records.delete(response_id)

    async def close(self) -> None:
        pass


class KVStoreResponseStore:
    """Records in the kvstore service at ``target`` (its channel opens on first use, inside the
    serving loop)."""

    def __init__(self, target: str, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 2.0) -> None:
        self.target, self.ttl_s, self.timeout_s = target, ttl_s, timeout_s
        self._open: AsyncKVStoreClient | None = None

    @property
    def _client(self) -> AsyncKVStoreClient:
        if self._open is None:
            self._open = AsyncKVStoreClient(self.target, timeout_s=self.timeout_s)
        return self._open

    async def put(self, record: StoredResponse) -> None:
        try:
            stored = await self._client.put_record(RECORD_NAMESPACE, record.response["id"], record.to_bytes(),
                                                   self.ttl_s)
        except KVStoreError as e:
            log.warning("response %s not stored: %s", record.response["id"], e)
            return
        if not stored:
            log.warning("response %s not stored: larger than the kvstore keeps", record.response["id"])

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            data = await self._client.get_record(RECORD_NAMESPACE, response_id)
        except KVStoreError as e:
            log.warning("stored response %s unreadable: %s", response_id, e)
            raise service_unavailable("stored responses cannot be read right now; retry later") from None
        return StoredResponse.from_bytes(data) if data is not None else None

    async def delete(self, response_id: str) -> bool:
        try:
            return await self._client.delete_record(RECORD_NAMESPACE, response_id)
        except KVStoreError as e:
            log.warning("stored response %s not deleted: %s", response_id, e)
            raise service_unavailable("stored responses cannot be deleted right now; retry later") from None

    async def close(self) -> None:
        if self._open is not None:
            await self._open.close()
