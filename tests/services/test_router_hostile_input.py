"""A hostile corpus against the router over real HTTP: every case gets a 4xx OpenAI error object
(never a 500, never a Python message), nothing reaches the backend, and the router keeps serving.
The backend converts every request's sampling to its proto, as the gRPC backend does, so a value
that would not survive the float32 / int cast fails the test."""

from __future__ import annotations

import json

import httpx
import pytest
from router_fixtures import MODEL_DIR, ScriptedBackend, serve

from glmserve.services.generation_proto import sampling_to_proto
from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"
LIMIT = 1 << 20  # the test app's body limit
MAX_CONTEXT = 4096
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class CountingTokenizer(Tokenizer):
    encodes = 0

    def encode(self, text: str) -> list[int]:
        CountingTokenizer.encodes += 1
        return super().encode(text)


class ProtoBackend(ScriptedBackend):
    async def generate(self, request_id, prompt_ids, params, hints=None):
        sampling_to_proto(params)  # raises on what the wire cannot carry
        async for event in super().generate(request_id, prompt_ids, params, hints):
            yield event


@pytest.fixture(scope="module")
def setup():
    tokenizer = CountingTokenizer.from_dir(MODEL_DIR)
    backend = ProtoBackend(lambda _: tokenizer.encode("ok"), tokenizer)
    app = create_app(backend, tokenizer, MODEL, max_context=MAX_CONTEXT, max_body_bytes=LIMIT)
    with serve(app) as base, httpx.Client(base_url=base, timeout=60) as http:
        yield http, backend


def with_fields(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


def with_content(content_json: str) -> bytes:
    return f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {content_json}}}]}}'.encode()


DEEP = "[" * 5000 + "]" * 5000
CORPUS = {
    "nested 5000 deep, unknown field": with_fields()[:-1] + b', "x": ' + DEEP.encode() + b"}",
    "nested 5000 deep, content": with_content(DEEP),
    "lone surrogate": with_content('"\\ud800x"'),
    "invalid utf-8": with_content('"\xff"').replace("\xff".encode(), b"\xff"),
    "tool_calls of numbers": with_fields(messages=[{"role": "assistant", "tool_calls": [1, 2]}]),
    "tool_calls function a string": with_fields(messages=[{"role": "assistant", "tool_calls": [{"function": "nope"}]}]),
    "tool_calls on a user message": with_fields(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
    "temperature 1e308": with_fields(temperature=1e308),
    "top_p 1e-46": with_fields(top_p=1e-46),
    "repetition_penalty 1e308": with_fields(repetition_penalty=1e308),
    "min_p 1e-46": with_fields(min_p=1e-46),
    "top_k past int32": with_fields(top_k=2**40),
    "seed past int64": with_fields(seed=2**70),
    "max_tokens of 5000 digits": with_fields()[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}",
    "too many stop strings": with_fields(stop=["x"] * 1000),
    "a body that is not an object": b'["not", "an", "object"]',
    "not json": b"{'model': 1}",
    "content a number": with_content("1e999"),
}


@pytest.mark.parametrize("case", list(CORPUS))
def test_hostile_body_is_a_400_openai_error(setup, case):
    http, backend = setup
    before = len(backend.generated)
    resp = http.post("/v1/chat/completions", content=CORPUS[case], headers={"content-type": "application/json"})
    assert resp.status_code == 400, (case, resp.text)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    for leak in ("Traceback", "pydantic", "<class", "Error(", "object at 0x"):
        assert leak not in error["message"], (case, error)
    assert len(backend.generated) == before
    assert http.post("/v1/chat/completions", json=GOOD).status_code == 200  # still serving


def test_a_body_over_the_limit_is_413_declared_or_streamed(setup):
    http, backend = setup
    big = with_content(json.dumps("x" * (3 * LIMIT)))
    resp = http.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: refused once the limit is passed while it arrives
        for start in range(0, len(big), 64 << 10):
            yield big[start:start + (64 << 10)]

    try:
        resp = http.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
        assert resp.status_code == 413
    except httpx.WriteError:  # the server answered and closed before the client finished sending
        pass
    assert http.post("/v1/chat/completions", json=GOOD).status_code == 200
    assert not any(len(prompt) > MAX_CONTEXT for _, prompt, _ in backend.generated)


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(setup):
    http, _ = setup
    encodes = CountingTokenizer.encodes
    huge = "word " * (LIMIT // 6)  # within the body limit, far past the context
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                       ("/v1/completions", {"prompt": huge})):
        resp = http.post(path, json={"model": MODEL, **body})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
        assert "at least" in resp.json()["error"]["message"]
    assert CountingTokenizer.encodes == encodes
