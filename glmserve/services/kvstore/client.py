"""Typed clients of the kvstore service, for workers (publish events) and the router (lookups).

``KVStoreClient`` blocks its calling thread (engine loops, tools); ``AsyncKVStoreClient`` is the
same API for an asyncio loop (the router: never block its loop, DESIGN invariant 7); create it
inside the running loop. Every call has a deadline (``timeout_s``) and raises ``KVStoreError`` on
any failure; ``error.unavailable`` tells "service or index down, fall back" apart from a bad request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from glmserve.core.errors import GlmServeError
from glmserve.kv.block_index import PrefixMatch, Tier, check_event
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2 as pb
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2_grpc as pb_grpc

EventKind = Literal["stored", "removed"]
_KIND_TO_PROTO = {"stored": pb.EVENT_KIND_STORED, "removed": pb.EVENT_KIND_REMOVED}
_TIER_TO_PROTO = {Tier.DEVICE: pb.TIER_DEVICE, Tier.HOST: pb.TIER_HOST}


class KVStoreError(GlmServeError):
    """A kvstore call failed; ``code`` is the gRPC status code."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"kvstore {method} failed: {code.name}: {details}")
        self.method, self.code, self.details = method, code, details

    @property
    def unavailable(self) -> bool:
        """The service or its index cannot answer now (retry later or use a local view)."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class BlockEvent:
    """One stored / removed event; hashes of a stored event in chain order."""

    kind: EventKind
    worker: str
    tier: Tier | str
    hashes: Sequence[bytes]


@dataclass(frozen=True)
class HostAttachment:
    """The host tier as a worker sees it after ``host_attach``."""

    target_info: bytes  # where the worker writes host blocks (its transfer backend connects here)
    num_blocks: int
    holder_id: str  # index holder id of host-tier blocks (tier HOST)
    instance_id: str = ""  # the kvstore process attached to (a restart changes it)


@dataclass(frozen=True)
class HostWriteGrant:
    """Host blocks reserved for a write: ``hashes[i]`` goes to host row ``block_ids[i]``; lease 0:
    nothing to write."""

    lease_id: int
    hashes: list[bytes]
    block_ids: list[int]


@dataclass(frozen=True)
class HostLoadOutcome:
    blocks_loaded: int
    drained: bool
    error: str


@dataclass(frozen=True)
class KVStoreHealth:
    backend: str  # "memory" or "redis"
    index_up: bool
    detail: str
    instance_id: str = ""  # new after a kvstore restart
    index_epoch: str = ""  # new when index entries may have been lost; empty while the index is down


def _events_to_proto(events: Iterable[BlockEvent]) -> pb.EventBatch:
    batch = pb.EventBatch()
    for e in events:
        if e.kind not in _KIND_TO_PROTO:
            raise ValueError(f"kind: must be 'stored' or 'removed', got {e.kind!r}")
        worker, tier, hashes = check_event(e.worker, e.tier, e.hashes)
        batch.events.add(kind=_KIND_TO_PROTO[e.kind], worker_id=worker, tier=_TIER_TO_PROTO[tier],
                         block_hashes=hashes)
    return batch


def _matches_from_proto(response: pb.LookupResponse) -> dict[str, PrefixMatch]:
    return {m.worker_id: PrefixMatch(m.device_blocks, m.host_blocks) for m in response.matches}


def _health_from_proto(response: pb.HealthResponse) -> KVStoreHealth:
    return KVStoreHealth(response.index_backend, response.index_up, response.detail, response.instance_id,
                         response.index_epoch)


def _error(method: str, e: grpc.RpcError) -> KVStoreError:
    return KVStoreError(method, e.code(), e.details() or "")  # type: ignore[attr-defined]


class KVStoreClient:
    """Blocking client. ``target`` is ``host:port``; ``timeout_s`` is every call's deadline."""

    def __init__(self, target: str, *, timeout_s: float = 1.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.target, self.timeout_s = target, timeout_s
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    def publish(self, events: Iterable[BlockEvent]) -> int:
        """Applies ``events`` in order, all or none validated first; returns how many were applied."""
        return self._call("PublishEvents", _events_to_proto(events)).events_applied

    def publish_stored(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        self.publish([BlockEvent("stored", worker, tier, hashes)])

    def publish_removed(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        self.publish([BlockEvent("removed", worker, tier, hashes)])

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]:
        """Per worker, the leading blocks of ``hashes`` it holds on each tier (see BlockIndex.match)."""
        return _matches_from_proto(self._call("Lookup", pb.LookupRequest(block_hashes=list(hashes))))

    def remove_worker(self, worker: str) -> int:
        return self._call("RemoveWorker", pb.RemoveWorkerRequest(worker_id=worker)).entries_removed

    def health(self) -> KVStoreHealth:
        return _health_from_proto(self._call("Health", pb.HealthRequest()))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any) -> Any:  # typed by the public methods
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _error(method, e) from None


class AsyncKVStoreClient:
    """``KVStoreClient`` for asyncio (``grpc.aio``); construct it inside the running event loop."""

    def __init__(self, target: str, *, timeout_s: float = 1.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        self.target, self.timeout_s = target, timeout_s
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.KVStoreStub(self._channel)

    async def publish(self, events: Iterable[BlockEvent]) -> int:
        return (await self._call("PublishEvents", _events_to_proto(events))).events_applied

    async def publish_stored(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        await self.publish([BlockEvent("stored", worker, tier, hashes)])

    async def publish_removed(self, worker: str, tier: Tier | str, hashes: Sequence[bytes]) -> None:
        await self.publish([BlockEvent("removed", worker, tier, hashes)])

    async def lookup(self, hashes: Sequence[bytes]) -> dict[str, PrefixMatch]:
        return _matches_from_proto(await self._call("Lookup", pb.LookupRequest(block_hashes=list(hashes))))

    async def remove_worker(self, worker: str) -> int:
        return (await self._call("RemoveWorker", pb.RemoveWorkerRequest(worker_id=worker))).entries_removed

    async def health(self) -> KVStoreHealth:
        return _health_from_proto(await self._call("Health", pb.HealthRequest()))

    # -- host tier (see proto/glmserve/kvstore/v1/kvstore.proto) -----------------------------------

    async def host_attach(self, worker: str, transfer_kind: str, block_bytes: int, target_info: bytes,
                          row_offset: int = 0, row_bytes: int = 0) -> HostAttachment:
        """``row_offset``/``row_bytes``: a LayerSplit stage's slice of the whole-model host blocks."""
        r = await self._call("HostAttach", pb.HostAttachRequest(
            worker_id=worker, transfer_kind=transfer_kind, block_bytes=block_bytes, target_info=target_info,
            row_offset=row_offset, row_bytes=row_bytes))
        return HostAttachment(r.target_info, r.num_blocks, r.holder_id, r.instance_id)

    async def host_lookup(self, hashes: Sequence[bytes]) -> int:
        return (await self._call("HostLookup", pb.LookupRequest(block_hashes=list(hashes)))).num_blocks

    async def host_begin_write(self, worker: str, hashes: Sequence[bytes],
                               part: tuple[int, int] | None = None) -> HostWriteGrant:
        """``part``: (stage, stages) of a LayerSplit stage writing its slices."""
        stage, stages = part or (0, 0)
        r = await self._call("HostBeginWrite", pb.HostBeginWriteRequest(
            worker_id=worker, block_hashes=list(hashes), part_stage=stage, part_stages=stages))
        return HostWriteGrant(r.lease_id, list(r.block_hashes), list(r.host_block_ids))

    async def host_end_write(self, lease_id: int, committed: bool) -> int:
        """Commit or give back a lease (give back only once the write is drained); hashes stored."""
        r = await self._call("HostEndWrite", pb.HostEndWriteRequest(lease_id=lease_id, committed=committed),
                             timeout_s=max(self.timeout_s, 10.0))
        return r.stored

    async def host_load(self, worker: str, request_id: str, generation: int, hashes: Sequence[bytes],
                        dest_block_ids: Sequence[int], *, timeout_s: float) -> HostLoadOutcome:
        """Ask the host tier to write the leading stored run of ``hashes`` into our blocks; answers
        when that write is final. ``timeout_s``: the call's deadline (the agreed transfer timeout)."""
        r = await self._call("HostLoad", pb.HostLoadRequest(
            worker_id=worker, request_id=request_id, generation=generation, block_hashes=list(hashes),
            dest_block_ids=list(dest_block_ids)), timeout_s=timeout_s)
        return HostLoadOutcome(r.blocks_loaded, r.drained, r.error)

    async def host_cancel_load(self, request_id: str, generation: int) -> tuple[bool, bool]:
        """(found, drained) of a running load."""
        r = await self._call("HostCancelLoad", pb.HostCancelLoadRequest(request_id=request_id,
                                                                         generation=generation),
                             timeout_s=max(self.timeout_s, 70.0))
        return r.found, r.drained

    # -- client records (stored Responses) --------------------------------------------------------

    async def put_record(self, namespace: str, key: str, value: bytes, ttl_s: float) -> bool:
        """Keep ``value`` under (namespace, key) for ``ttl_s``; False: too large to keep."""
        r = await self._call("PutRecord", pb.PutRecordRequest(namespace=namespace, key=key, value=value, ttl_s=ttl_s))
        return r.stored

    async def get_record(self, namespace: str, key: str) -> bytes | None:
        """The value, or None when unknown or expired."""
        r = await self._call("GetRecord", pb.GetRecordRequest(namespace=namespace, key=key))
        return r.value if r.found else None

    async def delete_record(self, namespace: str, key: str) -> bool:
        """Forget (namespace, key); False when it was unknown or expired."""
        r = await self._call("DeleteRecord", pb.DeleteRecordRequest(namespace=namespace, key=key))
        return r.found

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise _error(method, e) from None
