"""How the stages of a LayerSplit replica call each other: the `StagePort` the head drives every
stage through (its own included, `LocalStage`), and `GrpcStage`, the ``glmserve.prefill.v1.Stage``
client, which is also what a stage needs of the next one (`NextStage`).

Every failure is a `StageCallError` with a code: ``gone`` (no stage answers at that address any
more: the process died or stopped; it writes nothing more), ``full`` (out of KV blocks),
``invalid``, ``not_found`` (the job is not running there), ``failed`` (e.g. the decode worker's
buffer unreachable) or ``error``. ``abort`` never raises: it answers drained True / False, or None
when the stage is gone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import grpc

from glmserve.core.errors import GlmServeError
from glmserve.kv.block_pool import OutOfBlocks
from glmserve.kv.transfer import TransferError
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2, stage_pb2
from glmserve.proto_gen.glmserve.prefill.v1 import stage_pb2_grpc as pb_grpc
from glmserve.services.generation_proto import sampling_to_proto as to_proto
from glmserve.services.prefill.stage_job import StageJobSpec, StageOutcome
from glmserve.services.prefill.stage_worker import StageWorker
from glmserve.services.prefill_proto import reply_from_proto

T = TypeVar("T")


class StageCallError(GlmServeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"stage {code}: {message}")
        self.code = code


class StagePort(Protocol):
    name: str

    async def begin(self, spec: StageJobSpec) -> int: ...

    async def admit(self, request_id: str, generation: int, num_cached: int, chunk_tokens: int,
                    stream: bool) -> None: ...

    async def finish(self, request_id: str, generation: int) -> StageOutcome: ...

    async def abort(self, request_id: str, generation: int, reason: str) -> bool | None: ...

    async def ready(self) -> bool: ...


async def _local(call: Awaitable[T]) -> T:
    try:
        return await call
    except OutOfBlocks as e:
        raise StageCallError("full", str(e)) from None
    except KeyError as e:
        raise StageCallError("not_found", str(e)) from None
    except ValueError as e:
        raise StageCallError("invalid", str(e)) from None
    except TransferError as e:
        raise StageCallError("failed", str(e)) from None


class LocalStage:
    """The head's own stage as a `StagePort`."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker, self.name = worker, "stage 0"

    async def begin(self, spec: StageJobSpec) -> int:
        return await _local(self.worker.begin(spec))

    async def admit(self, request_id: str, generation: int, num_cached: int, chunk_tokens: int, stream: bool) -> None:
        await _local(self.worker.admit(request_id, generation, num_cached, chunk_tokens, stream))

    async def finish(self, request_id: str, generation: int) -> StageOutcome:
        return await _local(self.worker.finish(request_id, generation))

    async def abort(self, request_id: str, generation: int, reason: str) -> bool | None:
        return (await self.worker.abort(request_id, generation, reason)).drained

    async def ready(self) -> bool:
        return self.worker.ready()


_CODES = {
    grpc.StatusCode.UNAVAILABLE: "gone",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "full",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.FAILED_PRECONDITION: "failed",
}
# A restarted stage at the same address is used again within ~2 s.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
BEGIN_WAIT_S = 30.0


def _id(request_id: str, generation: int) -> common_pb.TransferId:
    return common_pb.TransferId(request_id=request_id, generation=generation)


class GrpcStage:
    """One stage at ``address`` (host:port), over ``glmserve.prefill.v1.Stage``."""

    def __init__(self, address: str, index: int, rpc_timeout_s: float = 60.0,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> None:
        self.address, self.name = address, f"stage {index} at {address}"
        self._timeout_s = rpc_timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS, interceptors=list(interceptors))
        self._stub = pb_grpc.StageStub(self._channel)

    async def _call(self, rpc: Callable[..., Awaitable[T]], request: object, timeout_s: float | None = None,
                    wait_for_ready: bool = False) -> T:
        try:
            return await rpc(request, timeout=timeout_s or self._timeout_s, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as e:
            code = _CODES.get(e.code(), "error")
            raise StageCallError(code, f"{self.name}: {e.code().name}: {e.details()}") from None

    async def begin(self, spec: StageJobSpec) -> int:
        request = stage_pb2.StageJob(
            transfer=_id(spec.request_id, spec.generation), prompt_ids=list(spec.prompt_ids),
            sampling=to_proto(spec.params), decode_target=spec.decode_target,
            dest_block_ids=list(spec.dest_block_ids), checksum=spec.checksum, cache_salt=spec.cache_salt)
        # A job's first call rides out a reconnect (a stage that just came back): a stage that stays
        # gone fails it within BEGIN_WAIT_S; later calls fail at once.
        reply = await self._call(self._stub.Begin, request, BEGIN_WAIT_S, wait_for_ready=True)
        return reply.num_cached_tokens

    async def admit(self, request_id: str, generation: int, num_cached: int, chunk_tokens: int, stream: bool) -> None:
        await self._call(self._stub.Admit, stage_pb2.StageAdmit(
            transfer=_id(request_id, generation), num_cached_tokens=num_cached, chunk_tokens=chunk_tokens,
            stream=stream))

    async def finish(self, request_id: str, generation: int) -> StageOutcome:
        reply = await self._call(self._stub.Finish, stage_pb2.StageJobRef(transfer=_id(request_id, generation)),
                                 timeout_s=2 * self._timeout_s)
        handoff = reply_from_proto(reply.first)[0] if reply.HasField("first") else None
        writes = tuple(zip(reply.write_started, reply.write_finished, reply.write_bytes, strict=True))
        return StageOutcome(reply.ok, reply.error, reply.drained, handoff, reply.computed_at, writes)

    async def abort(self, request_id: str, generation: int, reason: str) -> bool | None:
        request = prefill_pb2.AbortRequest(transfer=_id(request_id, generation), reason=reason)
        try:
            return (await self._call(self._stub.Abort, request)).drained
        except StageCallError as e:
            return None if e.code == "gone" else False

    async def ready(self) -> bool:
        try:
            return (await self._call(self._stub.Health, prefill_pb2.HealthRequest(), timeout_s=2.0)).ready
        except StageCallError:
            return False

    # --- NextStage: what the previous stage needs -------------------------------------------------

    async def activation_target(self) -> bytes:
        return (await self._call(self._stub.Health, prefill_pb2.HealthRequest())).activation_target

    async def slot(self, request_id: str, generation: int, chunk: int) -> int:
        request = stage_pb2.StageSlotRequest(transfer=_id(request_id, generation), chunk=chunk)
        return (await self._call(self._stub.Slot, request)).slot

    async def chunk(self, request_id: str, generation: int, chunk: int, slot: int, start: int, num_tokens: int,
                    topk_width: int, stamp: bytes) -> None:
        await self._call(self._stub.Chunk, stage_pb2.StageChunk(
            transfer=_id(request_id, generation), chunk=chunk, slot=slot, start=start, num_tokens=num_tokens,
            topk_width=topk_width, stamp=stamp))

    async def close(self) -> None:
        await self._channel.close()
