"""How a decode worker talks to prefill workers: the `PrefillPort` it needs, and its gRPC client.

`PrefillPort` keeps the decode worker transport-free (tests drive it with an in-process fake);
`GrpcPrefillClient` is the real one, with one cached ``grpc.aio`` channel per prefill target.

Abort answers (`AbortAnswer`), and what the decode worker concludes about its destination blocks:
- DRAINED: the prefill worker confirmed no more bytes can land (it replies only once drained).
- NOT_DRAINED: it could not confirm that (the write's connection died mid-write).
- PEER_GONE: the call failed with UNAVAILABLE: no prefill server answers at that address any
  more. A prefill worker drains its transfers before its server stops, and a killed one writes
  nothing more (NIXL copies are done by the writer process; a TCP receiver only finishes copying
  what is already in its socket buffer, milliseconds), so the blocks are free after a short grace.
- NO_ANSWER: anything else (deadline, internal error): wait out the agreed timeout.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from glmserve.core.errors import GlmServeError
from glmserve.core.generation import SamplingParams
from glmserve.engine.handoff import PrefillOutput
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as pb_grpc
from glmserve.services.generation_proto import sampling_to_proto
from glmserve.services.prefill_proto import reply_from_proto


@dataclass(frozen=True)
class PrefillCall:
    request_id: str
    generation: int
    prompt_ids: Sequence[int]
    params: SamplingParams
    decode_target: bytes
    dest_block_ids: Sequence[int]
    transfer_kind: str
    checksum: bool
    cache_salt: str = ""  # tenant prefix-cache salt; empty: none


@dataclass(frozen=True)
class PrefillAnswer:
    output: PrefillOutput  # the first token and the MTP seed
    stamp: bytes  # TransferStamp.encode() of the completed transfer
    num_stages: int = 1  # LayerSplit: the stages that each wrote their slice, in parts


class PrefillCallError(GlmServeError):
    """A Prefill call ended without an answer. ``code``: aborted (destination drained), invalid
    (rejected before anything was written), unavailable, timeout, cancelled or error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"prefill {code}: {message}")
        self.code = code

    @property
    def drained(self) -> bool:
        """True when the error itself proves nothing more lands in the destination."""
        return self.code in ("aborted", "invalid")


class AbortAnswer(enum.Enum):
    DRAINED = "drained"
    NOT_DRAINED = "not_drained"
    PEER_GONE = "peer_gone"
    NO_ANSWER = "no_answer"


class PrefillPort(Protocol):
    async def prefill(self, target: str, call: PrefillCall, timeout_s: float) -> PrefillAnswer:
        """The answer, or ``PrefillCallError``."""
        ...

    async def abort(self, target: str, request_id: str, generation: int, reason: str,
                    timeout_s: float) -> AbortAnswer:
        """Never raises."""
        ...

    async def close(self) -> None: ...


_CODES = {
    grpc.StatusCode.ABORTED: "aborted",
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}


# A prefill worker restarted at the same address is used again within ~1 s (gRPC's default
# reconnect backoff grows to 120 s, and calls fail fast meanwhile: the router retries those).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class GrpcPrefillClient:
    """`PrefillPort` over gRPC; ``target`` is the prefill worker's host:port. ``interceptors``: of
    every channel (tracing's, which carry the request's trace context to prefill)."""

    def __init__(self, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> None:
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.PrefillStub]] = {}
        self._interceptors = list(interceptors)

    def _stub(self, target: str) -> pb_grpc.PrefillStub:
        if target not in self._stubs:
            channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS, interceptors=self._interceptors)
            self._stubs[target] = (channel, pb_grpc.PrefillStub(channel))
        return self._stubs[target][1]

    async def prefill(self, target: str, call: PrefillCall, timeout_s: float) -> PrefillAnswer:
        request = pb.PrefillRequest(
            transfer=common_pb.TransferId(request_id=call.request_id, generation=call.generation),
            prompt_ids=list(call.prompt_ids),
            sampling=sampling_to_proto(call.params),
            decode_target=call.decode_target,
            dest_block_ids=list(call.dest_block_ids),
            transfer_kind=call.transfer_kind,
            checksum=call.checksum,
            cache_salt=call.cache_salt,
        )
        try:
            reply = await self._stub(target).Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            code = _CODES.get(e.code(), "error")
            raise PrefillCallError(code, f"{target}: {e.code().name}: {e.details()}") from None
        return PrefillAnswer(*reply_from_proto(reply), num_stages=max(1, reply.num_stages))

    async def abort(self, target: str, request_id: str, generation: int, reason: str,
                    timeout_s: float) -> AbortAnswer:
        request = pb.AbortRequest(
            transfer=common_pb.TransferId(request_id=request_id, generation=generation), reason=reason
        )
        try:
            reply = await self._stub(target).Abort(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            return AbortAnswer.PEER_GONE if e.code() == grpc.StatusCode.UNAVAILABLE else AbortAnswer.NO_ANSWER
        return AbortAnswer.DRAINED if reply.drained else AbortAnswer.NOT_DRAINED

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
