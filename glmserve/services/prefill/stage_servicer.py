"""gRPC servicer of ``glmserve.prefill.v1.Stage`` (grpc.aio): a thin adapter over `StageWorker`.

Status codes: INVALID_ARGUMENT for a bad request, RESOURCE_EXHAUSTED when the stage is out of KV
blocks, NOT_FOUND for a job that is not running here, FAILED_PRECONDITION when the decode worker's
buffer cannot be reached. UNAVAILABLE is left to the transport: it means this stage is gone.
A cancelled Finish call (the head went away) aborts the job.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from glmserve.kv.block_pool import OutOfBlocks
from glmserve.kv.transfer import TransferError
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2, stage_pb2
from glmserve.proto_gen.glmserve.prefill.v1 import stage_pb2_grpc as pb_grpc
from glmserve.services.generation_proto import sampling_from_proto as from_proto
from glmserve.services.prefill.stage_job import StageJobSpec
from glmserve.services.prefill.stage_worker import StageWorker
from glmserve.services.prefill_proto import reply_to_proto

T = TypeVar("T")


async def _answer(call: Awaitable[T], context: grpc.aio.ServicerContext) -> T:
    try:
        return await call
    except OutOfBlocks as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except KeyError as e:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except TransferError as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    raise AssertionError("unreachable")  # context.abort raises


class StageServicer(pb_grpc.StageServicer):
    def __init__(self, worker: StageWorker) -> None:
        self._worker = worker

    async def Begin(self, request: stage_pb2.StageJob, context: grpc.aio.ServicerContext) -> stage_pb2.StageBeginReply:
        t = request.transfer

        async def begin() -> int:  # from_proto raises ValueError naming the field: INVALID_ARGUMENT
            spec = StageJobSpec(t.request_id, t.generation, list(request.prompt_ids), from_proto(request.sampling),
                                request.decode_target, list(request.dest_block_ids), request.checksum,
                                request.cache_salt)
            return await self._worker.begin(spec)

        return stage_pb2.StageBeginReply(num_cached_tokens=await _answer(begin(), context))

    async def Admit(self, request: stage_pb2.StageAdmit, context: grpc.aio.ServicerContext) -> stage_pb2.StageAdmitReply:
        t = request.transfer
        await _answer(self._worker.admit(t.request_id, t.generation, request.num_cached_tokens,
                                         request.chunk_tokens, request.stream), context)
        return stage_pb2.StageAdmitReply()

    async def Finish(self, request: stage_pb2.StageJobRef,
                     context: grpc.aio.ServicerContext) -> stage_pb2.StageFinishReply:
        t = request.transfer
        try:
            outcome = await _answer(self._worker.finish(t.request_id, t.generation), context)
        except asyncio.CancelledError:  # the head is gone: nobody will use what this job writes
            task = asyncio.ensure_future(self._worker.abort(t.request_id, t.generation, "the head went away"))
            task.add_done_callback(lambda f: f.exception())
            raise
        reply = stage_pb2.StageFinishReply(ok=outcome.ok, error=outcome.error, drained=outcome.drained,
                                           computed_at=outcome.computed_at,
                                           write_started=[w[0] for w in outcome.writes],
                                           write_finished=[w[1] for w in outcome.writes],
                                           write_bytes=[w[2] for w in outcome.writes])
        if outcome.handoff is not None:
            reply.first.CopyFrom(reply_to_proto(outcome.handoff, b""))
        return reply

    async def Slot(self, request: stage_pb2.StageSlotRequest,
                   context: grpc.aio.ServicerContext) -> stage_pb2.StageSlotReply:
        t = request.transfer
        slot = await _answer(self._worker.slot(t.request_id, t.generation, request.chunk), context)
        return stage_pb2.StageSlotReply(slot=slot)

    async def Chunk(self, request: stage_pb2.StageChunk, context: grpc.aio.ServicerContext) -> stage_pb2.StageChunkReply:
        t = request.transfer
        await _answer(self._worker.chunk(t.request_id, t.generation, request.chunk, request.slot, request.start,
                                         request.num_tokens, request.topk_width, request.stamp), context)
        return stage_pb2.StageChunkReply()

    async def Abort(self, request: prefill_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.AbortReply:
        t = request.transfer
        outcome = await self._worker.abort(t.request_id, t.generation, request.reason or "abort")
        return prefill_pb2.AbortReply(found=outcome.found, drained=outcome.drained)

    async def Health(self, request: prefill_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> stage_pb2.StageHealthReply:
        w = self._worker
        return stage_pb2.StageHealthReply(ready=w.ready(), stage=w.settings.index, free_blocks=w.engine.snapshot.free_blocks,
                                          activation_target=w.activation_target, running=w.running)

