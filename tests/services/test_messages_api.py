"""``/v1/messages`` with the unmodified `anthropic` client against a real router (uvicorn on
127.0.0.1) over a scripted backend: the prompt is the chat template's rendering of the same
conversation, ``tool_use`` / ``tool_result`` blocks round-trip exactly, tool_choice reaches the
chat path's enforcement, the stream's events add up to the whole message, and bad input is a 4xx in
Anthropic's error shape."""

from __future__ import annotations

import json

import httpx
import pytest
from router_fixtures import HAS_MODEL, MODEL_DIR, ScriptedBackend, agent_script, serve

from glmserve.services.router.app import create_app
from glmserve.text.special_tokens import TOOL_CALL_START
from glmserve.text.tokenizer import Tokenizer

anthropic = pytest.importorskip("anthropic")

MODEL = "glm52-tiny"
KEY = "sk-messages"
TOOL = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CHAT_TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                              "parameters": TOOL["input_schema"]}}

pytestmark = pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def served(tokenizer):
    backend = ScriptedBackend(agent_script(tokenizer), tokenizer)
    with serve(create_app(backend, tokenizer, MODEL, api_keys=[KEY], max_context=4096)) as url:
        yield backend, url


@pytest.fixture()
def backend(served):
    served[0].is_ready = True
    return served[0]


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[1], api_key=KEY, max_retries=0, timeout=60)


def _user(text):
    return [{"role": "user", "content": text}]


def test_text_turn_becomes_the_chat_prompt(client, backend, tokenizer):
    msg = client.messages.create(model=MODEL, max_tokens=100, system=[{"type": "text", "text": "Be brief."}],
                                 messages=_user("hello"), metadata={"user_id": "sess-7"})
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "one two three four five six"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None and msg.role == "assistant"
    _, prompt, params = backend.generated[-1]
    assert prompt == tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "hello"}])
    assert backend.hints[-1].session_id == "sess-7" and params.max_tokens == 100
    assert (msg.usage.input_tokens, msg.usage.output_tokens, msg.usage.cache_read_input_tokens) == (len(prompt), 8, 0)
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=_user("hello"))
    assert counted.input_tokens == len(prompt)


def test_stop_reasons_and_sampling(client, backend):
    stopped = client.messages.create(model=MODEL, max_tokens=100, messages=_user("x"), stop_sequences=["three"])
    assert stopped.content[0].text == "one two " and stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "three"
    # This client version no longer sends sampling fields itself; other clients and agents do.
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=_user("x"),
                                 extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
    assert cut.content[0].text == "one two" and cut.stop_reason == "max_tokens"
    params = backend.generated[-1][2]
    assert (params.temperature, params.top_p, params.top_k) == (0.5, pytest.approx(0.9), 7)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.messages.create(model=MODEL, max_tokens=2, messages=_user("x"),
                           output_config={"format": {"type": "json_schema", "schema": schema}})
    grammar = backend.generated[-1][2].grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.schema) == schema and grammar.strict


def test_tool_use_round_trip(client, backend, tokenizer):
    first = client.messages.create(model=MODEL, max_tokens=100, tools=[TOOL], messages=_user("SCRIPT-CALL"))
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert (first.content[0].text, use.name, use.input) == ("Let me look.", "read_file", {"path": "a.py"})
    messages = _user("SCRIPT-CALL") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "hello"}]}]}]
    second = client.messages.create(model=MODEL, max_tokens=100, tools=[TOOL], messages=messages)
    assert second.content[0].text == "The file says hello." and second.stop_reason == "end_turn"
    conversation = [
        {"role": "user", "content": "SCRIPT-CALL"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "content": "hello", "tool_call_id": use.id},
    ]
    assert backend.generated[-1][1] == tokenizer.apply_chat_template(conversation, [CHAT_TOOL])


def test_stream_adds_up_to_the_whole_message(client):
    kwargs = {"model": MODEL, "max_tokens": 100, "tools": [TOOL], "messages": _user("SCRIPT-CALL")}
    whole = client.messages.create(**kwargs)
    events = list(client.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"] and kinds.count("content_block_stop") == 2
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert set(deltas) == {"text_delta", "input_json_delta"}
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.input_tokens == whole.usage.input_tokens


def test_tool_choice_maps_to_the_chat_enforcement(client, backend, tokenizer):
    base = {"model": MODEL, "max_tokens": 100, "tools": [TOOL], "messages": _user("SCRIPT-CALL")}
    client.messages.create(**base, tool_choice={"type": "any"})
    grammar = backend.generated[-1][2].grammar
    assert grammar.kind == "tool_calls" and grammar.tool_choice == "required" and grammar.parallel_tool_calls
    client.messages.create(**base, tool_choice={"type": "tool", "name": "read_file",
                                                "disable_parallel_tool_use": True})
    grammar = backend.generated[-1][2].grammar
    assert grammar.tool_choice == "read_file" and not grammar.parallel_tool_calls
    plain = client.messages.create(**base, tool_choice={"type": "none"})
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"
    _, prompt, params = backend.generated[-1]
    assert prompt == tokenizer.apply_chat_template(_user("SCRIPT-CALL"))  # the tools are not offered
    start = tokenizer.token_to_id(TOOL_CALL_START)  # no call may start (banned, or biased away)
    assert start in getattr(params, "banned_token_ids", ()) or dict(params.logit_bias).get(start, 0) < 0


@pytest.mark.parametrize("fields, status", [
    ({"max_tokens": None}, 400),
    ({"messages": []}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, 400),
    ({"temperature": 1.5}, 400),
    ({"output_config": {"format": {"type": "json_schema"}}}, 400),
    ({"tools": [TOOL], "tool_choice": {"type": "any"}, "output_config": {"format": {"type": "json_schema",
                                                                                    "schema": {}}}}, 400),
    ({"stop_sequences": "x"}, 400),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, 400),
    ({"tool_choice": {"type": "any"}}, 400),
    ({"max_tokens": 10**6}, 400),
    ({"model": "claude-x"}, 404),
])
def test_bad_input_is_a_4xx_in_anthropic_shape(served, fields, status):
    body = {"model": MODEL, "max_tokens": 10, "messages": _user("hi"), **fields}
    body = {k: v for k, v in body.items() if v is not None}
    reply = httpx.post(f"{served[1]}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_client_errors_and_refusals(served, client, backend):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "system", "content": "x"}])
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served[1], api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=10, messages=_user("hi"))
    backend.is_ready = False
    reply = httpx.post(f"{served[1]}/v1/messages", headers={"x-api-key": KEY},
                       json={"model": MODEL, "max_tokens": 10, "messages": _user("hi"), "stream": True})
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "overloaded_error"
    assert "retry-after" in reply.headers
    backend.is_ready = True
    schema = httpx.get(f"{served[1]}/openapi.json").json()
    assert {"MessagesRequest", "CountTokensRequest"} <= set(schema["components"]["schemas"])


def test_body_schemas_do_not_clash_in_openapi():
    """`/openapi.json` puts every body's models in one namespace: one name, one schema."""
    from glmserve.services.router.app import BODIES

    seen: dict[str, dict] = {}
    for model in BODIES.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, definition in {**schema.pop("$defs", {}), model.__name__: schema}.items():
            assert seen.setdefault(name, definition) == definition, f"two models named {name}"


def test_a_failure_is_an_anthropic_error_never_a_cut_stream(client, backend):
    backend.fail_with, backend.fail_after = "decode worker 10.1.2.3:5001 died", 0
    try:
        with pytest.raises(anthropic.InternalServerError) as e:  # before the first token: an HTTP status
            client.messages.create(model=MODEL, max_tokens=10, messages=_user("hi"), stream=True)
        assert e.value.body["error"]["type"] == "api_error" and "<address>" in e.value.body["error"]["message"]
        backend.fail_after = 2  # after tokens went out: an error event
        with pytest.raises(anthropic.APIStatusError) as e:
            list(client.messages.create(model=MODEL, max_tokens=10, messages=_user("hi"), stream=True))
        assert "<address>" in str(e.value)
        with pytest.raises(anthropic.InternalServerError):
            client.messages.create(model=MODEL, max_tokens=10, messages=_user("hi"))
    finally:
        backend.fail_with, backend.fail_after = None, 0
    assert client.messages.create(model=MODEL, max_tokens=10, messages=_user("hi")).stop_reason == "end_turn"
