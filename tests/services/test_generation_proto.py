"""The generation contract's wire form: every field of `SamplingParams` and `TokenEvent` crosses."""

import dataclasses

import pytest

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.core.grammar_spec import GrammarSpec
from glmserve.engine.handoff import PrefillOutput
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as prefill_pb
from glmserve.services.generation_proto import (
    event_from_proto,
    event_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from glmserve.services.prefill_proto import reply_from_proto, reply_to_proto

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def test_sampling_round_trip():
    for params in (SamplingParams(), GREEDY, SamplingParams(max_tokens=3, temperature=0.5, top_p=0.25,
                   top_k=7, seed=2**64 - 1, stop_token_ids=(5,), stop=("x",), ignore_eos=True, logprobs=2,
                   visible_special_tokens=("<tool_call>",))):
        back = sampling_from_proto(sampling_to_proto(params))
        assert dataclasses.replace(back, seed=params.seed, temperature=params.temperature,
                                   top_p=params.top_p) == params
        assert back.temperature == pytest.approx(params.temperature) and back.top_p == pytest.approx(params.top_p)
        assert back.seed is None or back.seed % 2**64 == params.seed % 2**64  # same torch generator
    with pytest.raises(ValueError, match="max_tokens"):
        sampling_from_proto(sampling_to_proto(GREEDY).__class__())  # an empty message: max_tokens 0


@pytest.mark.parametrize("grammar", [
    None,
    GrammarSpec("json_object"),
    GrammarSpec("json_schema", schema='{"type":"object","properties":{"b":{},"a":{}}}', strict=False,
                reasoning="auto"),
    GrammarSpec("tool_calls", tools='[{"type":"function","function":{"name":"f"}}]', tool_choice="f",
                parallel_tool_calls=False, reasoning="enabled"),
])
def test_processing_and_grammar_round_trip(grammar):
    params = SamplingParams(max_tokens=9, min_p=0.1, repetition_penalty=1.3, presence_penalty=-0.5,
                            frequency_penalty=2.0, logit_bias={5: -100.0, 2: 3.5}, grammar=grammar,
                            banned_token_ids=(12, 13), num_resumed=4)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(sampling_to_proto(GREEDY)) == GREEDY  # unset repetition_penalty is 1.0
    message = sampling_to_proto(params)
    message.grammar.kind = "yaml"
    with pytest.raises(ValueError, match="grammar.kind"):
        sampling_from_proto(message)


@pytest.mark.parametrize("event", [
    TokenEvent("r", [7]),
    TokenEvent("r", [7, 8], "hi", [-0.5, -0.25], [[(7, -0.5), (1, -1.5)], [(8, -0.25), (2, -2.0)]]),
    TokenEvent("r", [9], "", [-1.0], finish_reason="stop", stop_reason=9, num_cached_tokens=64),
    TokenEvent("r", [], "x", finish_reason="stop", stop_reason="###"),
    TokenEvent("r", [3], "y", finish_reason="length"),
    TokenEvent.ended("r", "error", "prefill worker died", num_cached_tokens=2),
    TokenEvent.ended("r", "abort"),
])
def test_event_round_trip(event):
    wire = decode_pb.GenerateEvent.FromString(event_to_proto(event).SerializeToString())
    assert event_from_proto("r", wire) == event  # the logprobs above are exact in float32


def test_event_request_id_is_the_receivers():
    assert event_from_proto("router-id", event_to_proto(TokenEvent("engine@1", [1]))).request_id == "router-id"


def test_unknown_finish_reason_reads_as_an_error():
    event = event_from_proto("r", decode_pb.GenerateEvent(finish_reason="exploded"))
    assert event.finish_reason == "error" and "exploded" in event.error


@pytest.mark.parametrize("output", [
    PrefillOutput(first_token=7, mtp_hidden=b"\x00\x01" * 8, num_cached_tokens=64),
    PrefillOutput(first_token=7, mtp_hidden=b"h" * 16, first_logprob=-0.5,
                  first_top_logprobs=[(7, -0.5), (3, -1.25)], num_cached_tokens=0),
])
def test_prefill_reply_round_trip(output):
    wire = prefill_pb.PrefillReply.FromString(reply_to_proto(output, b"stamp").SerializeToString())
    assert reply_from_proto(wire) == (output, b"stamp")
