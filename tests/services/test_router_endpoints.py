"""The router's smaller endpoints over real HTTP: GET /v1/models/{id}, /tokenize and /detokenize
(what a chat or completion request will count), ``x-request-id`` on every answer, and ``created``
taken per request."""

from __future__ import annotations

import time

import httpx
import pytest
from router_fixtures import ScriptedBackend, serve

from glmserve.services.router.app import create_app

MODEL = "glm52-tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def http(tokenizer):
    backend = ScriptedBackend(lambda _: tokenizer.encode("ok then"), tokenizer)
    with serve(create_app(backend, tokenizer, MODEL, api_keys=["k"], max_context=256)) as url:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=30) as client:
            yield client


def test_model_card_by_id(http):
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card == http.get("/v1/models").json()["data"][0] and card["id"] == MODEL
    missing = http.get("/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_counts_what_a_request_costs(http, tokenizer):
    prompt = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert prompt == {"tokens": tokenizer.encode("hello world"), "count": len(prompt["tokens"]), "max_model_len": 256}
    chat = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(MESSAGES, TOOLS)
    usage = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                    "max_tokens": 2}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": prompt["tokens"]}).json() == {
        "prompt": "hello world"}
    for path, body, param in [("/tokenize", {"model": MODEL}, "prompt"),
                              ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, "prompt"),
                              ("/detokenize", {"model": MODEL, "tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"model": MODEL, "tokens": ["a"]}, "tokens")]:
        bad = http.post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert http.post("/tokenize", json={"model": "x", "prompt": "a"}).status_code == 404
    assert httpx.post(f"{http.base_url}/tokenize", json={"model": MODEL, "prompt": "a"}).status_code == 401


def test_x_request_id_is_echoed_or_made(http):
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat, headers={"x-request-id": "abc-1"}).headers["x-request-id"] == "abc-1"
    made = http.post("/v1/chat/completions", json=chat).headers["x-request-id"]
    assert len(made) == 32 and made != http.get("/v1/models").headers["x-request-id"]
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                     headers={"x-request-id": "s-2"}) as stream:
        assert stream.headers["x-request-id"] == "s-2" and "[DONE]" in "".join(stream.iter_text())
    error = http.post("/v1/chat/completions", json={**chat, "n": 3}, headers={"x-request-id": "e-3"})
    assert error.status_code == 400 and error.headers["x-request-id"] == "e-3"
    assert http.get("/health", headers={"x-request-id": "x" * 129}).headers["x-request-id"] != "x" * 129


def test_created_is_the_request_time(http):
    time.sleep(1.1)  # past the second the server started in
    before = int(time.time())
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).json()
    assert before <= chat["created"] <= int(time.time())
    assert http.get(f"/v1/models/{MODEL}").json()["created"] < before
