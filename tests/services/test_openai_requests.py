"""Request parsing on its own (no HTTP): bodies become the sampling and prompt the backend gets.
The HTTP-level rejections (status, param) are in test_router_errors.py."""

from __future__ import annotations

import json

import pytest

from glmserve.services.router.errors import APIError
from glmserve.services.router.openai_requests import ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
VOCAB = 1000
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]


def _chat(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode())


def test_sampling_from_a_chat_body():
    body = _chat(temperature=0, top_p=0.5, top_k=3, seed=7, stop="END", max_tokens=9, max_completion_tokens=4,
                 logprobs=True, top_logprobs=2, ignore_eos=True)
    params = body.sampling_params(num_prompt=10, max_context=100, param="messages", vocab_size=VOCAB)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (4, 0, 0.5, 3, 7)
    assert params.stop == ("END",) and params.logprobs == 2 and params.ignore_eos
    assert _chat(logprobs=True).sampling_params(10, 100, "messages", VOCAB).logprobs == 0
    assert _chat().sampling_params(10, 100, "messages", VOCAB).logprobs is None


def test_without_max_tokens_the_completion_may_fill_the_context():
    assert _chat().sampling_params(num_prompt=30, max_context=100, param="messages", vocab_size=VOCAB).max_tokens == 70
    with pytest.raises(APIError) as e:
        _chat(max_tokens=71).sampling_params(num_prompt=30, max_context=100, param="messages", vocab_size=VOCAB)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"


def test_messages_are_normalised_for_the_template():
    body = _chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ])
    rendered = body.template_messages()
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert rendered[1]["content"] == "ab" and rendered[2]["content"] is None
    assert rendered[2]["tool_calls"][0]["function"]["name"] == "f" and rendered[3]["tool_call_id"] == "c1"


def test_penalties_bias_and_min_p_reach_the_sampling():
    body = _chat(temperature=0, min_p=0.2, repetition_penalty=1.1, presence_penalty=-1, frequency_penalty=2,
                 logit_bias={"5": -100, "17": 2.5})
    params = body.sampling_params(10, 100, "messages", VOCAB)
    assert (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        0.2, 1.1, -1, 2)
    assert params.logit_bias == ((5, -100.0), (17, 2.5))
    with pytest.raises(APIError) as e:
        _chat(logit_bias={"1000": 1}).sampling_params(10, 100, "messages", VOCAB)
    assert e.value.param == "logit_bias"


def test_grammar_from_response_format_and_tool_choice():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    body = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    spec = body.grammar()
    assert spec.kind == "json_schema" and json.loads(spec.schema) == schema and spec.strict
    assert list(json.loads(spec.schema)["properties"]) == ["b", "a"]  # the order the grammar generates
    assert _chat(response_format={"type": "json_object"}).grammar().kind == "json_object"
    assert _chat(response_format={"type": "text"}).grammar() is None and _chat().grammar() is None
    required = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).grammar()
    assert (required.kind, required.tool_choice, required.parallel_tool_calls) == ("tool_calls", "required", False)
    assert [t["function"]["name"] for t in json.loads(required.tools)] == ["f", "g"]
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}).grammar()
    assert named.tool_choice == "g" and [t["function"]["name"] for t in json.loads(named.tools)] == ["g"]
    for free in ("auto", "none", None):
        assert _chat(tools=TOOLS, tool_choice=free).grammar() is None
    with_format = _chat(tools=TOOLS, tool_choice="auto", response_format={"type": "json_object"})
    assert with_format.grammar().kind == "json_object"
    completion = parse_body(CompletionRequest, json.dumps({"model": "m", "prompt": "x", "response_format": {
        "type": "json_object"}}).encode())
    assert completion.grammar().kind == "json_object"


def test_tools_are_active_unless_tool_choice_is_none():
    tools = TOOLS[:1]
    assert _chat(tools=tools).active_tools()[0]["function"]["name"] == "f"
    assert _chat(tools=tools, tool_choice="none").active_tools() is None
    assert _chat().active_tools() is None


@pytest.mark.parametrize(("prompt", "expected"), [("text", "text"), ([5, 6], [5, 6]), (["one"], "one"), ([[5]], [5])])
def test_a_completion_prompt_and_a_batch_of_one(prompt, expected):
    body = parse_body(CompletionRequest, json.dumps({"model": "m", "prompt": prompt, "logprobs": 3}).encode())
    assert body.prompt == expected and body.sampling_params(2, 100, "prompt", VOCAB).logprobs == 3


@pytest.mark.parametrize(("raw", "param"), [
    (b"{", None), (b"[]", None), (b'{"model": "m"}', "messages"),
    (json.dumps({**CHAT, "temperature": "1"}).encode(), "temperature"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}).encode(), "messages"),
    (json.dumps({**CHAT, "top_logprobs": 2}).encode(), "top_logprobs"),
    (b'{"a":' * 300 + b"1" + b"}" * 300, None),  # nested far too deep: a 400, not a crash
])
def test_rejections_name_the_field(raw, param):
    with pytest.raises(APIError) as e:
        parse_body(ChatCompletionRequest, raw)
    assert e.value.status == 400 and e.value.param == param
