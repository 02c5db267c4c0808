"""``/v1/responses`` with the unmodified `openai` client against a real router (uvicorn on
127.0.0.1) over a scripted backend: the prompt the backend receives is the chat template's
rendering of the same conversation (so caching and sessions are the chat path's), whole and
streamed answers agree, a function call round trip through ``previous_response_id`` rebuilds the
conversation exactly, and bad input is a 400 in OpenAI's error shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from router_fixtures import HAS_MODEL, MODEL_DIR, ScriptedBackend, agent_script, serve

from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"
KEY, OTHER_KEY = "sk-responses", "sk-other-tenant"
TOOL = {"type": "function", "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}

pytestmark = pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def served(tokenizer):
    backend = ScriptedBackend(agent_script(tokenizer), tokenizer)
    with serve(create_app(backend, tokenizer, MODEL, api_keys=[KEY, OTHER_KEY], max_context=4096)) as url:
        yield backend, url


@pytest.fixture()
def backend(served):
    backend = served[0]
    backend.is_ready = True
    return backend


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_text_input_becomes_the_chat_prompt(client, backend, tokenizer):
    resp = client.responses.create(model=MODEL, input="hello there", instructions="Be brief.", user="sess-1")
    assert resp.status == "completed" and resp.output_text == "one two three four five six"
    _, prompt, params = backend.generated[-1]
    assert prompt == tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "hello there"}])
    assert backend.hints[-1].session_id == "sess-1"  # session affinity as on the chat path
    assert resp.usage.input_tokens == len(prompt) and resp.usage.output_tokens == 8
    assert resp.usage.input_tokens_details.cached_tokens == 0 and resp.usage.total_tokens == len(prompt) + 8
    assert resp.instructions == "Be brief." and resp.model == MODEL and resp.id.startswith("resp_")
    assert params.max_tokens == 4096 - len(prompt)


def test_sessions_as_on_the_chat_path(client, backend):
    client.responses.create(model=MODEL, input="x", max_output_tokens=1, prompt_cache_key="conv-9")
    assert backend.hints[-1].session_id == "conv-9"  # what Codex sends per conversation
    client.responses.create(model=MODEL, input="x", max_output_tokens=1, extra_headers={"x-session-id": "h-1"})
    assert backend.hints[-1].session_id == "h-1"
    assert backend.hints[-1].cache_salt.startswith("key:")  # the key's own cache, as on chat


def test_sampling_and_limits_reach_the_backend(client, backend):
    resp = client.responses.create(model=MODEL, input="x", max_output_tokens=2, temperature=0.5, top_p=0.9)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "one two" and resp.output[0].status == "incomplete"
    params = backend.generated[-1][2]
    assert (params.max_tokens, params.temperature, params.top_p) == (2, 0.5, pytest.approx(0.9))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.responses.create(model=MODEL, input="x", max_output_tokens=2,
                            text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    grammar = backend.generated[-1][2].grammar
    assert grammar is not None and grammar.kind == "json_schema" and json.loads(grammar.schema) == schema


def test_stream_events_add_up_to_the_whole_response(client):
    whole = client.responses.create(model=MODEL, input="hi")
    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_function_call_round_trip_with_previous_response_id(client, backend, tokenizer):
    first = client.responses.create(model=MODEL, input="SCRIPT-CALL please", tools=[TOOL])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("read_file", {"path": "a.py"})]
    assert first.output[0].type == "message" and first.output_text == "Let me look."
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "hello"}])
    assert second.output_text == "The file says hello." and second.previous_response_id == first.id
    conversation = [
        {"role": "user", "content": "SCRIPT-CALL please"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": calls[0].call_id, "type": "function",
             "function": {"name": "read_file", "arguments": calls[0].arguments}}]},
        {"role": "tool", "content": "hello", "tool_call_id": calls[0].call_id},
    ]
    assert backend.generated[-1][1] == tokenizer.apply_chat_template(conversation, [CHAT_TOOL])
    # The same turn sent as explicit items (what a client that keeps its own history sends).
    client.responses.create(model=MODEL, tools=[TOOL], store=False, input=[
        {"role": "user", "content": "SCRIPT-CALL please"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "read_file", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "hello"}])
    assert backend.generated[-1][1] == tokenizer.apply_chat_template(conversation, [CHAT_TOOL])


def test_streamed_function_call_events(client):
    events = list(client.responses.create(model=MODEL, input="SCRIPT-CALL", tools=[TOOL], stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["message", "function_call"] and added[1].name == "read_file"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(pieces) == {"path": "a.py"} and done[0].arguments == pieces
    final = events[-1]
    assert final.type == "response.completed" and [i.type for i in final.response.output] == ["message", "function_call"]
    with client.responses.stream(model=MODEL, input="SCRIPT-CALL", tools=[TOOL]) as stream:  # the SDK's accumulator
        snapshot = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in snapshot.output] == [
        ("message", None), ("function_call", pieces)]
    assert snapshot.output_text == "Let me look."
    forced = client.responses.create(model=MODEL, input="SCRIPT-CALL", tools=[TOOL],
                                     tool_choice={"type": "function", "name": "read_file"})
    assert forced.output[-1].type == "function_call"


def test_store_false_keeps_nothing(client):
    resp = client.responses.create(model=MODEL, input="hi", store=False)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="again", previous_response_id=resp.id)
    assert e.value.body["param"] == "previous_response_id"


def test_another_tenant_never_reads_a_stored_response(client, served):
    resp = client.responses.create(model=MODEL, input="hi")
    other = openai.OpenAI(base_url=f"{served[1]}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(resp.id)
    with pytest.raises(openai.BadRequestError):
        other.responses.create(model=MODEL, input="go on", previous_response_id=resp.id)
    assert client.responses.retrieve(resp.id).id == resp.id


@pytest.mark.parametrize("fields, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "input"),  # prompt + output past the context, as chat names it
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}}, "text"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
])
def test_bad_input_is_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "hi", **fields})
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


def test_refusals_come_before_any_stream_byte(served, backend):
    url = served[1]
    backend.is_ready = False
    reply = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", "stream": True},
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "service_unavailable"
    backend.is_ready = True
    assert httpx.post(f"{url}/v1/responses", json={"model": "other", "input": "hi"},
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi"}).status_code == 401
    assert httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi"},
                      headers={"x-api-key": KEY}).status_code == 200
    schema = httpx.get(f"{url}/openapi.json").json()
    assert "ResponsesRequest" in schema["components"]["schemas"]
    assert schema["paths"]["/v1/responses"]["post"]["requestBody"]["required"]


def test_a_failure_is_an_error_answer_never_a_cut_stream(client, backend):
    backend.fail_with, backend.fail_after = "decode worker 10.1.2.3:5001 died", 0
    try:
        with pytest.raises(openai.InternalServerError) as e:  # before the first token: an HTTP status
            client.responses.create(model=MODEL, input="hi", stream=True)
        assert "<address>" in e.value.body["message"]
        backend.fail_after = 2  # after tokens went out: an error event, then response.failed
        events = list(client.responses.create(model=MODEL, input="hi", stream=True))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert events[-1].response.status == "failed" and "<address>" in events[-2].message
        with pytest.raises(openai.InternalServerError):
            client.responses.create(model=MODEL, input="hi")
    finally:
        backend.fail_with, backend.fail_after = None, 0
    assert client.responses.create(model=MODEL, input="hi").status == "completed"  # still serving


def test_delete_forgets_a_response_of_this_tenant_only(client, served):
    url, headers = served[1], {"Authorization": f"Bearer {KEY}"}
    resp = client.responses.create(model=MODEL, input="hi")
    other = openai.OpenAI(base_url=f"{url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):  # another tenant's response is as unknown to it
        other.responses.delete(resp.id)
    assert client.responses.retrieve(resp.id).id == resp.id
    reply = httpx.delete(f"{url}/v1/responses/{resp.id}", headers=headers)
    assert reply.status_code == 200 and reply.json() == {"id": resp.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(resp.id)
    assert e.value.body["code"] == "not_found" and resp.id in e.value.body["message"]
    for gone in (client.responses.delete, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            gone(resp.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="go on", previous_response_id=resp.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    streamed = list(client.responses.create(model=MODEL, input="hi", stream=True))[-1].response
    assert client.responses.delete(streamed.id) is None  # the SDK's own call
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)


def test_input_items_list_the_request_input_in_pages(client, served):
    sent = [
        {"role": "user", "content": "q1"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a1"}]},
        {"type": "function_call", "id": "fc_given", "call_id": "c1", "name": "read_file", "arguments": '{"path": "a"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "hello"},
        {"role": "developer", "content": [{"type": "input_text", "text": "q2"}, {"type": "input_text", "text": "!"}]},
    ]
    resp = client.responses.create(model=MODEL, input=sent, tools=[TOOL])
    listed = client.responses.input_items.list(resp.id, order="asc").data
    assert [item.type for item in listed] == [item.get("type", "message") for item in sent]
    assert listed[0].role == "user" and [(p.type, p.text) for p in listed[0].content] == [("input_text", "q1")]
    assert listed[1].summary[0].text == "thinking" and listed[2].content[0].type == "output_text"
    assert (listed[3].id, listed[3].call_id, listed[3].arguments) == ("fc_given", "c1", '{"path": "a"}')
    assert listed[4].output == "hello" and [p.text for p in listed[5].content] == ["q2", "!"]
    ids = [item.id for item in listed]
    assert len(set(ids)) == 6 and ids[0].startswith("msg_") and ids[1].startswith("rs_")
    assert [item.id for item in client.responses.input_items.list(resp.id)] == ids[::-1]  # desc by default
    page = client.responses.input_items.list(resp.id, limit=4, order="asc")
    assert [item.id for item in page.data] == ids[:4] and page.has_more
    rest = page.get_next_page()
    assert [item.id for item in rest.data] == ids[4:] and not rest.has_more
    assert [item.id for item in client.responses.input_items.list(resp.id, limit=2)] == ids[::-1]  # auto-paging
    reply = httpx.get(f"{served[1]}/v1/responses/{resp.id}/input_items", params={"limit": 1, "after": ids[4]},
                      headers={"Authorization": f"Bearer {KEY}"}).json()
    assert reply == {"object": "list", "data": [reply["data"][0]], "first_id": ids[3], "last_id": ids[3],
                     "has_more": True}
    text_only = client.responses.create(model=MODEL, input="just text", stream=True)
    text_id = list(text_only)[-1].response.id
    assert [(i.role, i.content[0].text) for i in client.responses.input_items.list(text_id).data] == [
        ("user", "just text")]


@pytest.mark.parametrize("query, param", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "many"}, "limit"),
    ({"order": "sideways"}, "order"), ({"after": "msg_unknown"}, "after"),
])
def test_bad_input_items_queries_are_a_400_naming_the_parameter(client, served, query, param):
    resp = client.responses.create(model=MODEL, input="hi")
    reply = httpx.get(f"{served[1]}/v1/responses/{resp.id}/input_items", params=query,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_input_items_are_the_tenants_own(client, served):
    resp = client.responses.create(model=MODEL, input="hi")
    other = openai.OpenAI(base_url=f"{served[1]}/v1", api_key=OTHER_KEY, max_retries=0)
    for response_id, reader in ((resp.id, other), ("resp_unknown", client)):
        with pytest.raises(openai.NotFoundError):
            reader.responses.input_items.list(response_id)
    schema = httpx.get(f"{served[1]}/openapi.json").json()["paths"]
    assert set(schema["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert sorted(schema["/v1/responses/{response_id}/input_items"]["get"]["responses"]) == [
        "200", "400", "401", "404"]
