"""`PrefillOutput` (what a finished prefill hands to decode) <-> ``glmserve.prefill.v1.PrefillReply``.

Used by the prefill servicer (answer) and decode's prefill client (reading the answer); every
field crosses, the first token's top logprobs included. Logprobs travel as float32.
"""

from __future__ import annotations

from glmserve.engine.handoff import PrefillOutput
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as pb
from glmserve.services.generation_proto import top_logprobs_from_proto, top_logprobs_to_proto


def reply_to_proto(output: PrefillOutput, stamp: bytes, num_stages: int = 1) -> pb.PrefillReply:
    """``stamp``: ``TransferStamp.encode()`` of the completed transfer; ``num_stages``: a LayerSplit
    replica's stages, each of which wrote its slice in parts (1: the one write ``stamp`` names)."""
    reply = pb.PrefillReply(
        first_token=output.first_token,
        mtp_hidden=output.mtp_hidden,
        stamp=stamp,
        num_cached_tokens=output.num_cached_tokens,
        first_top_logprobs=top_logprobs_to_proto(output.first_top_logprobs),
        num_stages=num_stages,
    )
    if output.first_logprob is not None:
        reply.first_logprob = output.first_logprob
    return reply


def reply_from_proto(reply: pb.PrefillReply) -> tuple[PrefillOutput, bytes]:
    """(the prefill's output, the encoded transfer stamp)."""
    output = PrefillOutput(
        first_token=reply.first_token,
        mtp_hidden=reply.mtp_hidden,
        first_logprob=reply.first_logprob if reply.HasField("first_logprob") else None,
        first_top_logprobs=top_logprobs_from_proto(reply.first_top_logprobs),
        num_cached_tokens=reply.num_cached_tokens,
    )
    return output, reply.stamp
