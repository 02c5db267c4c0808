"""gRPC servicer of ``glmserve.kvstore.v1.KVStore``: a thin adapter over a ``BlockIndex``.

It converts messages, validates a whole event batch before applying any of it (a bad batch changes
nothing), and maps errors to status codes: ``ValueError`` -> INVALID_ARGUMENT,
``IndexUnavailable`` -> UNAVAILABLE (the caller falls back at once instead of waiting).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from glmserve.kv.block_index import BlockIndex, IndexUnavailable, Tier, check_event
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2 as pb
from glmserve.proto_gen.glmserve.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from glmserve.services.kvstore.host_tier import HostTier, HostTierUnavailable
from glmserve.services.kvstore.metrics import KVStoreMetrics
from glmserve.services.kvstore.records import MemoryRecords, Records

R = TypeVar("R")

TIER_FROM_PROTO = {pb.TIER_DEVICE: Tier.DEVICE, pb.TIER_HOST: Tier.HOST}
TIER_TO_PROTO = {tier: value for value, tier in TIER_FROM_PROTO.items()}
KIND_FROM_PROTO = {pb.EVENT_KIND_STORED: "stored", pb.EVENT_KIND_REMOVED: "removed"}
# The codes `_rpc` answers failures with; every (rpc, code) is exported as 0 from the start, so the
# first failure shows in rate() too.
ERROR_CODES = ("INVALID_ARGUMENT", "UNAVAILABLE", "FAILED_PRECONDITION", "NOT_FOUND", "DEADLINE_EXCEEDED")


def _rpc(fn: Callable[[Any, Any, grpc.ServicerContext], R]) -> Callable[[Any, Any, grpc.ServicerContext], R]:
    """Maps the index's errors to gRPC status codes and counts failures."""

    @functools.wraps(fn)
    def handler(self: KVStoreServicer, request: Any, context: grpc.ServicerContext) -> R:
        try:
            return fn(self, request, context)
        except ValueError as e:
            code, details = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except IndexUnavailable as e:
            code, details = grpc.StatusCode.UNAVAILABLE, f"block index unavailable: {e}"
        except HostTierUnavailable as e:
            code, details = grpc.StatusCode.FAILED_PRECONDITION, f"host tier: {e}"
        except KeyError as e:
            code, details = grpc.StatusCode.NOT_FOUND, f"unknown or expired lease: {e}"
        except TimeoutError as e:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, str(e)
        if self.metrics is not None:
            self.metrics.rpc_errors.labels(rpc=fn.__name__, code=code.name).inc()
        context.abort(code, details)  # raises

    handler.counts_errors = True  # type: ignore[attr-defined]
    return handler


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Serves one ``BlockIndex``, when given a ``HostTier``, and client records (in this process
    unless ``records`` says where); thread-safe because they are."""

    def __init__(self, index: BlockIndex, metrics: KVStoreMetrics | None = None,
                 host_tier: HostTier | None = None, records: Records | None = None) -> None:
        self.index = index
        self.metrics = metrics
        self.host_tier = host_tier
        self.records = records if records is not None else MemoryRecords()
        self.instance_id = uuid.uuid4().hex  # a restarted kvstore is a new instance
        if metrics is not None:
            for name in dir(type(self)):
                if getattr(getattr(type(self), name), "counts_errors", False):
                    for code in ERROR_CODES:
                        metrics.rpc_errors.labels(rpc=name, code=code)

    def _host_tier(self) -> HostTier:
        if self.host_tier is None:
            raise HostTierUnavailable("this kvstore runs without a host tier (--host-tier-bytes)")
        return self.host_tier

    @_rpc
    def PublishEvents(self, request: pb.EventBatch, context: grpc.ServicerContext) -> pb.Ack:
        events = [_event_from_proto(i, e) for i, e in enumerate(request.events)]
        for kind, worker, tier, hashes in events:
            (self.index.stored if kind == "stored" else self.index.removed)(worker, tier, hashes)
            if self.metrics is not None:
                self.metrics.events.labels(kind=kind).inc()
        return pb.Ack(events_applied=len(events))

    @_rpc
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        matches = self.index.match(list(request.block_hashes))
        if self.metrics is not None:
            self.metrics.lookups.inc()
        return pb.LookupResponse(matches=[
            pb.WorkerMatch(worker_id=w, device_blocks=m.device_blocks, host_blocks=m.host_blocks)
            for w, m in matches.items()
        ])

    @_rpc
    def RemoveWorker(self, request: pb.RemoveWorkerRequest,
                     context: grpc.ServicerContext) -> pb.RemoveWorkerResponse:
        return pb.RemoveWorkerResponse(entries_removed=self.index.remove_worker(request.worker_id))

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        up = self.index.healthy()
        detail = "" if up else f"cannot reach the index backend: {self.index.describe()}"
        return pb.HealthResponse(index_backend=self.index.backend, index_up=up, detail=detail,
                                 instance_id=self.instance_id, index_epoch=self.index.epoch() if up else "")


    # -- host tier: thin adapters over HostTier ---------------------------------------------------

    @_rpc
    def HostAttach(self, request: pb.HostAttachRequest, context: grpc.ServicerContext) -> pb.HostAttachResponse:
        host = self._host_tier()
        target, num_blocks = host.attach(request.worker_id, request.transfer_kind, request.block_bytes,
                                         request.target_info, row_offset=request.row_offset,
                                         row_bytes=request.row_bytes)
        return pb.HostAttachResponse(target_info=target, num_blocks=num_blocks, holder_id=host.holder_id,
                                     instance_id=self.instance_id)

    @_rpc
    def HostLookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.HostLookupResponse:
        return pb.HostLookupResponse(num_blocks=self._host_tier().lookup(list(request.block_hashes)))

    @_rpc
    def HostBeginWrite(self, request: pb.HostBeginWriteRequest,
                       context: grpc.ServicerContext) -> pb.HostWriteLease:
        part = (request.part_stage, request.part_stages) if request.part_stages else None
        lease = self._host_tier().begin_write(list(request.block_hashes), part)
        if not lease.block_ids:  # nothing to write: no lease to end
            self._host_tier().end_write(lease.lease_id, committed=False)
            return pb.HostWriteLease(lease_id=0)
        return pb.HostWriteLease(lease_id=lease.lease_id, block_hashes=lease.hashes,
                                 host_block_ids=lease.block_ids)

    @_rpc
    def HostEndWrite(self, request: pb.HostEndWriteRequest,
                     context: grpc.ServicerContext) -> pb.HostEndWriteResponse:
        return pb.HostEndWriteResponse(stored=self._host_tier().end_write(request.lease_id, request.committed))

    @_rpc
    def HostLoad(self, request: pb.HostLoadRequest, context: grpc.ServicerContext) -> pb.HostLoadResponse:
        result = self._host_tier().load(request.worker_id, request.request_id, request.generation,
                                   list(request.block_hashes), list(request.dest_block_ids))
        return pb.HostLoadResponse(blocks_loaded=result.blocks_loaded, drained=result.drained,
                                   error=result.error)

    @_rpc
    def HostCancelLoad(self, request: pb.HostCancelLoadRequest,
                       context: grpc.ServicerContext) -> pb.HostCancelLoadResponse:
        found, drained = self._host_tier().cancel_load(request.request_id, request.generation)
        return pb.HostCancelLoadResponse(found=found, drained=drained)


    # -- client records --------------------------------------------------------------------------

    @_rpc
    def PutRecord(self, request: pb.PutRecordRequest, context: grpc.ServicerContext) -> pb.PutRecordResponse:
        return pb.PutRecordResponse(stored=self.records.put(request.namespace, request.key, request.value,
                                                            request.ttl_s))

    @_rpc
    def GetRecord(self, request: pb.GetRecordRequest, context: grpc.ServicerContext) -> pb.GetRecordResponse:
        value = self.records.get(request.namespace, request.key)
        return pb.GetRecordResponse(found=value is not None, value=value or b"")

    @_rpc
    def DeleteRecord(self, request: pb.DeleteRecordRequest,
                     context: grpc.ServicerContext) -> pb.DeleteRecordResponse:
        return pb.DeleteRecordResponse(found=self.records.delete(request.namespace, request.key))


def _event_from_proto(i: int, event: pb.BlockEvent) -> tuple[str, str, Tier, list[bytes]]:
    kind = KIND_FROM_PROTO.get(event.kind)
    if kind is None:
        raise ValueError(f"events[{i}].kind: must be STORED or REMOVED, got {event.kind}")
    tier = TIER_FROM_PROTO.get(event.tier)
    if tier is None:
        raise ValueError(f"events[{i}].tier: must be DEVICE or HOST, got {event.tier}")
    try:
        worker, tier, hashes = check_event(event.worker_id, tier, event.block_hashes)
    except ValueError as e:
        raise ValueError(f"events[{i}].{e}") from None
    return kind, worker, tier, hashes
