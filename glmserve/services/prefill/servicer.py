"""gRPC servicer of ``glmserve.prefill.v1.Prefill`` (grpc.aio): a thin adapter over `PrefillWorker`.

Status codes: INVALID_ARGUMENT for a bad request; ABORTED when Abort arrived for this (request id,
generation) and the destination is drained; UNAVAILABLE for every other end without a result
(decode unreachable, transfer failed, not drained, shutting down) with the reason in the details.
A cancelled Prefill call aborts its job (the worker does that; the handler just goes away).
"""

from __future__ import annotations

import grpc

from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as pb_grpc
from glmserve.services.generation_proto import sampling_from_proto
from glmserve.services.prefill.job import PrefillAborted, PrefillError, PrefillJob
from glmserve.services.prefill.replica import StagedPrefill
from glmserve.services.prefill.worker import PrefillWorker
from glmserve.services.prefill_proto import reply_to_proto


class PrefillServicer(pb_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker | StagedPrefill, worker_id: str) -> None:
        self._worker = worker
        self._worker_id = worker_id

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillReply:
        try:
            result = await self._worker.prefill(_job(request))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PrefillError as e:
            aborted = isinstance(e, PrefillAborted) and e.drained
            await context.abort(grpc.StatusCode.ABORTED if aborted else grpc.StatusCode.UNAVAILABLE, str(e))
        return reply_to_proto(result.output, result.stamp.encode(), result.num_stages)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        outcome = await self._worker.abort(
            request.transfer.request_id, request.transfer.generation, request.reason or "abort"
        )
        return pb.AbortReply(found=outcome.found, drained=outcome.drained)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        h = self._worker.health()
        return pb.HealthReply(ready=h.ready, worker_id=self._worker_id, running=h.running,
                              waiting=h.waiting, free_blocks=h.free_blocks, cache_root=h.cache_root,
                              block_size=h.block_size)


def _job(request: pb.PrefillRequest) -> PrefillJob:
    """Raises ``ValueError`` naming the field."""
    if not request.transfer.request_id:
        raise ValueError("transfer.request_id: must not be empty")
    return PrefillJob(
        request_id=request.transfer.request_id,
        generation=request.transfer.generation,
        prompt_ids=list(request.prompt_ids),
        params=sampling_from_proto(request.sampling),
        decode_target=request.decode_target,
        dest_block_ids=list(request.dest_block_ids),
        transfer_kind=request.transfer_kind,
        checksum=request.checksum,
        cache_salt=request.cache_salt,
    )
