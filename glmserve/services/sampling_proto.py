"""`SamplingParams` <-> ``glmserve.common.v1.Sampling`` (the proto every worker RPC carries).

proto3 cannot tell an unset scalar from its zero, so two zeros read as "unset":
``top_p`` 0 means 1.0 (off) and ``top_k`` 0 means -1 (off); ``temperature`` 0 is greedy, as in
`SamplingParams`. A seed travels as int64: seeds >= 2**63 wrap to negative, which seeds torch's
generator identically (it reads the seed as uint64). Everything else maps one to one, and
``from_proto`` validates through `SamplingParams` (``ValueError`` naming the field: the servicers
answer INVALID_ARGUMENT).
"""

from __future__ import annotations

from glmserve.engine.sampling_params import SamplingParams
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb


def to_proto(params: SamplingParams) -> common_pb.Sampling:
    message = common_pb.Sampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        message.seed = params.seed - 2**64 if params.seed >= 2**63 else params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    return message


def from_proto(message: common_pb.Sampling) -> SamplingParams:
    """Raises ``ValueError("<field>: ...")`` for an invalid value."""
    return SamplingParams(
        max_tokens=message.max_tokens,
        temperature=float(message.temperature),
        top_p=float(message.top_p) if message.top_p != 0 else 1.0,
        top_k=message.top_k if message.top_k != 0 else -1,
        seed=message.seed if message.HasField("seed") else None,
        stop_token_ids=tuple(message.stop_token_ids),
        stop=tuple(message.stop),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
    )
