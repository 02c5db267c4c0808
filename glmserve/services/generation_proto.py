"""The generation contract (`glmserve.core.generation`) on the wire: `SamplingParams` <->
``glmserve.common.v1.Sampling`` (every worker RPC carries it) and `TokenEvent` <->
``glmserve.decode.v1.GenerateEvent`` (decode's stream to the router). Every field of both types
crosses; nothing is recomputed on the other side (DESIGN invariant 10).

proto3 cannot tell an unset scalar from its zero, so two zeros read as "unset":
``top_p`` 0 means 1.0 (off) and ``top_k`` 0 means -1 (off); ``temperature`` 0 is greedy, as in
`SamplingParams`; ``repetition_penalty`` is optional (unset: 1.0). The grammar travels as its
`GrammarSpec` fields (schema and tools as JSON text), so every worker compiles the same grammar. A seed travels as int64: seeds >= 2**63 wrap to negative, which seeds torch's
generator identically (it reads the seed as uint64). Everything else maps one to one, and
``sampling_from_proto`` validates through `SamplingParams` (``ValueError`` naming the field: the
servicers answer INVALID_ARGUMENT). Logprobs travel as float32.
"""

from __future__ import annotations

from glmserve.core.generation import FINISH_REASONS, SamplingParams, TokenEvent, TopLogprobs
from glmserve.core.grammar_spec import GrammarSpec
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb


def sampling_to_proto(params: SamplingParams) -> common_pb.Sampling:
    message = common_pb.Sampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        visible_special_tokens=list(params.visible_special_tokens),
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=[common_pb.LogitBias(token_id=t, bias=b) for t, b in params.logit_bias],
        banned_token_ids=list(params.banned_token_ids),
        num_resumed=params.num_resumed,
    )
    if params.repetition_penalty != 1.0:
        message.repetition_penalty = params.repetition_penalty
    if params.grammar is not None:
        message.grammar.CopyFrom(grammar_to_proto(params.grammar))
    if params.seed is not None:
        message.seed = params.seed - 2**64 if params.seed >= 2**63 else params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    return message


def sampling_from_proto(message: common_pb.Sampling) -> SamplingParams:
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
        visible_special_tokens=tuple(message.visible_special_tokens),
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        logit_bias=tuple((b.token_id, b.bias) for b in message.logit_bias),
        grammar=grammar_from_proto(message.grammar) if message.HasField("grammar") else None,
        banned_token_ids=tuple(message.banned_token_ids),
        num_resumed=message.num_resumed,
    )


def grammar_to_proto(spec: GrammarSpec) -> common_pb.Grammar:
    return common_pb.Grammar(kind=spec.kind, schema=spec.schema, strict=spec.strict, tools=spec.tools,
                             tool_choice=spec.tool_choice, parallel_tool_calls=spec.parallel_tool_calls,
                             reasoning=spec.reasoning)


def grammar_from_proto(message: common_pb.Grammar) -> GrammarSpec:
    """Raises ``ValueError`` for an invalid value (an unknown kind, say)."""
    try:
        return GrammarSpec(message.kind, message.schema, message.strict, message.tools, message.tool_choice,
                           message.parallel_tool_calls, message.reasoning)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"grammar.{e}") from e


def top_logprobs_to_proto(top: TopLogprobs) -> common_pb.TopLogprobs:
    return common_pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])


def top_logprobs_from_proto(message: common_pb.TopLogprobs) -> TopLogprobs:
    return list(zip(message.token_ids, message.logprobs, strict=True))


def event_to_proto(event: TokenEvent) -> decode_pb.GenerateEvent:
    """The event without its ``request_id`` (the stream it travels on names the request)."""
    message = decode_pb.GenerateEvent(
        token_ids=event.token_ids,
        text=event.text,
        logprobs=event.logprobs,
        top_logprobs=[top_logprobs_to_proto(top) for top in event.top_logprobs],
        finish_reason=event.finish_reason or "",
        error=event.error or "",
        num_cached_tokens=event.num_cached_tokens,
    )
    if isinstance(event.stop_reason, str):
        message.stop_string = event.stop_reason
    elif event.stop_reason is not None:
        message.stop_token_id = event.stop_reason
    return message


def event_from_proto(request_id: str, message: decode_pb.GenerateEvent) -> TokenEvent:
    """An unknown finish reason (a newer sender) reads as "error" naming it."""
    reason = message.finish_reason or None
    if reason is not None and reason not in FINISH_REASONS:
        return TokenEvent.ended(request_id, "error", f"finish_reason: unknown value {reason!r}")
    stop_field = message.WhichOneof("stop_reason")
    return TokenEvent(
        request_id,
        token_ids=list(message.token_ids),
        text=message.text,
        logprobs=list(message.logprobs),
        top_logprobs=[top_logprobs_from_proto(top) for top in message.top_logprobs],
        finish_reason=reason,  # type: ignore[arg-type]  # checked above
        stop_reason=getattr(message, stop_field) if stop_field is not None else None,
        num_cached_tokens=message.num_cached_tokens,
        error=message.error or None,
    )
