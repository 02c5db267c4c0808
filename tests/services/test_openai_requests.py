"""Request parsing on its own (no HTTP): bodies become the sampling and prompt the backend gets.
The HTTP-level rejections (status, param) are in test_router_errors.py."""

from __future__ import annotations

import json

import pytest

from glmserve.services.router.errors import APIError
from glmserve.services.router.openai_requests import ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _chat(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode())


def test_sampling_from_a_chat_body():
    body = _chat(temperature=0, top_p=0.5, top_k=3, seed=7, stop="END", max_tokens=9, max_completion_tokens=4,
                 logprobs=True, top_logprobs=2, ignore_eos=True)
    params = body.sampling_params(num_prompt=10, max_context=100, param="messages")
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (4, 0, 0.5, 3, 7)
    assert params.stop == ("END",) and params.logprobs == 2 and params.ignore_eos
    assert _chat(logprobs=True).sampling_params(10, 100, "messages").logprobs == 0
    assert _chat().sampling_params(10, 100, "messages").logprobs is None


def test_without_max_tokens_the_completion_may_fill_the_context():
    assert _chat().sampling_params(num_prompt=30, max_context=100, param="messages").max_tokens == 70
    with pytest.raises(APIError) as e:
        _chat(max_tokens=71).sampling_params(num_prompt=30, max_context=100, param="messages")
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


def test_tools_are_active_unless_tool_choice_is_none():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _chat(tools=tools).active_tools()[0]["function"]["name"] == "f"
    assert _chat(tools=tools, tool_choice="none").active_tools() is None
    assert _chat().active_tools() is None


@pytest.mark.parametrize(("prompt", "expected"), [("text", "text"), ([5, 6], [5, 6]), (["one"], "one"), ([[5]], [5])])
def test_a_completion_prompt_and_a_batch_of_one(prompt, expected):
    body = parse_body(CompletionRequest, json.dumps({"model": "m", "prompt": prompt, "logprobs": 3}).encode())
    assert body.prompt == expected and body.sampling_params(2, 100, "prompt").logprobs == 3


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
