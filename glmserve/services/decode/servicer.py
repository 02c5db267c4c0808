"""gRPC servicer of ``glmserve.decode.v1.Decode`` (grpc.aio): a thin adapter over `DecodeWorker`.

``Generate`` streams the worker's events. Before any event: INVALID_ARGUMENT for a bad request,
RESOURCE_EXHAUSTED when this worker has no KV blocks for the prompt now, UNAVAILABLE when it does
not serve (loading, shutting down); the router may retry the last two on another decode worker.
ABORTED instead of a first event: the request failed before any token for a reason of its path
(the prefill worker could not be reached, e.g. while this worker's channel to a restarted one
reconnects; the transfer did not arrive): nothing was generated, the router tries again. When the
client cancels the call (or it ends any other way before the final event) the request is aborted
at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as pb_grpc
from glmserve.services.decode.worker import DecodeFull, DecodeUnavailable, DecodeWorker
from glmserve.services.generation_proto import event_to_proto, sampling_from_proto


class DecodeServicer(pb_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, worker_id: str) -> None:
        self._worker = worker
        self._worker_id = worker_id

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        try:
            if not request.transfer.request_id:
                raise ValueError("transfer.request_id: must not be empty")
            stream = await self._worker.generate(
                request.transfer.request_id,
                request.transfer.generation,
                list(request.prompt_ids),
                sampling_from_proto(request.sampling),
                request.prefill_target,
                request.cache_salt,
                request.prefill_locally,
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except DecodeFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except DecodeUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finished = False
        try:
            async for event in stream:
                finished = event.finished
                if finished and event.finish_reason == "error" and stream.retryable:
                    await context.abort(grpc.StatusCode.ABORTED, event.error or "the request's path failed")
                yield event_to_proto(event)
        finally:
            if not finished:  # cancelled by the client, or the stream broke: abort everywhere now
                stream.abort()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        found = self._worker.abort(request.transfer.request_id, request.transfer.generation,
                                   request.reason or "abort")
        return pb.AbortReply(found=found)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        h = self._worker.health()
        return pb.HealthReply(ready=h.ready, worker_id=self._worker_id, running=h.running,
                              waiting=h.waiting, free_blocks=h.free_blocks, cache_root=h.cache_root,
                              block_size=h.block_size)

