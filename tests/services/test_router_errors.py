"""Router errors over real HTTP: each bad request gets the right status and an OpenAI error object,
never reaches the backend, and the router keeps serving (DESIGN.md invariant 6)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_fixtures import MODEL_DIR, ScriptedBackend, serve

from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"
KEY = "sk-test-key"
MAX_CONTEXT = 256
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return ScriptedBackend(lambda _: tokenizer.encode("ok then"), tokenizer)


@pytest.fixture(scope="module")
def base(backend, tokenizer):
    app = create_app(backend, tokenizer, MODEL, api_keys=[KEY], max_context=MAX_CONTEXT)
    with serve(app) as url:
        yield url


@pytest.fixture()
def http(base):
    with httpx.Client(base_url=base, headers=AUTH, timeout=30) as client:
        yield client


@pytest.fixture(autouse=True)
def _reset(backend):
    backend.is_ready, backend.fail_with = True, None
    backend.generated.clear()


def _error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param and err["code"] == code
    return err


BAD_CHAT = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
    ),
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": "8"}, "max_completion_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}}, "response_format"),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"model": 7}, "model"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_CHAT, ids=[f"{p}:{i}" for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_chat_body_is_400(http, backend, patch, param):
    err = _error(http.post("/v1/chat/completions", json={**CHAT, **patch}), 400, param)
    assert err["type"] == "invalid_request_error"
    assert backend.generated == []


def test_malformed_json_and_non_object_body_are_400(http, backend):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        _error(
            http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}), 400
        )
    assert backend.generated == []


def test_unknown_model_is_404(http, backend):
    err = _error(
        http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "model", "model_not_found"
    )
    assert "gpt-9" in err["message"]
    _error(
        http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model", "model_not_found"
    )
    assert backend.generated == []


def test_prompt_longer_than_the_context_is_400(http, backend):
    long = {"role": "user", "content": "word " * MAX_CONTEXT}
    _error(
        http.post("/v1/chat/completions", json={**CHAT, "messages": [long]}),
        400,
        "messages",
        "context_length_exceeded",
    )
    # Fits alone, but not with max_tokens on top.
    _error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 200, "max_tokens": 100}),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert backend.generated == []


def test_bad_completion_prompts_are_400(http, backend, tokenizer):
    for prompt in ("", [], [tokenizer.vocab_size], ["a", "b"], [[1], [2]], [True], None):
        _error(http.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400, "prompt")
    _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 6}), 400, "logprobs")
    assert backend.generated == []


def test_api_key_required_on_v1_only(base, backend):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=headers)
        _error(resp, 401, None, "invalid_api_key")
        _error(httpx.get(f"{base}/v1/models", headers=headers), 401, None, "invalid_api_key")
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200
    assert backend.generated == []


def test_not_ready_is_503_with_retry_after(http, base, backend):
    backend.is_ready = False
    resp = http.post("/v1/chat/completions", json=CHAT)
    _error(resp, 503, None, "service_unavailable")
    assert int(resp.headers["Retry-After"]) >= 1
    assert httpx.get(f"{base}/ready").status_code == 503
    assert httpx.get(f"{base}/health").status_code == 200
    assert backend.generated == []
    backend.is_ready = True
    assert httpx.get(f"{base}/ready").status_code == 200


def test_backend_failure_is_500_or_an_sse_error_event(http, backend):
    backend.fail_with = "worker died"
    err = _error(http.post("/v1/chat/completions", json=CHAT), 500, None, "internal_error")
    assert "worker died" in err["message"]
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert '"error"' in lines[-2] and "worker died" in lines[-2] and lines[-1] == "data: [DONE]"


def test_unknown_route_and_method_use_the_error_format(http):
    _error(http.get("/v1/nothing"), 404, None, "not_found")
    _error(http.get("/v1/chat/completions"), 405)


def test_still_serving_after_bad_requests_and_errors_are_counted(http, base, backend):
    http.post("/v1/chat/completions", json={**CHAT, "n": 3})
    resp = http.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "ok then"
    assert len(backend.generated) == 1
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
    counted = {(s.labels["endpoint"], s.labels["status"]) for f in families for s in f.samples
               if s.name == "glmserve_router_requests_total" and s.value > 0}
    for status in ("200", "400", "401", "503"):
        assert ("chat_completions", status) in counted, status
    assert {endpoint for endpoint, _ in counted} <= {"chat_completions", "completions", "models"}  # no /v1/nothing


def test_openapi_documents_the_request_bodies(base):
    schema = httpx.get(f"{base}/openapi.json").json()  # open: no key needed
    components = schema["components"]["schemas"]
    for path, name in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    chat = components["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])
    assert {"temperature", "top_p", "max_tokens", "logprobs", "top_logprobs", "tools", "stream"} <= set(chat["properties"])
    assert "ChatMessage" in components and "Tool" in components
    refs = set(re.findall(r'"#/components/schemas/([A-Za-z0-9_]+)"', json.dumps(schema)))
    assert refs and refs <= set(components)  # every reference resolves
