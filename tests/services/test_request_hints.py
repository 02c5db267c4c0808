"""Session ids and tenant cache salts over real HTTP: what reaches the backend, and 400s for bad
values (OpenAI error objects, nothing reaches the backend). Salt rules: see request_hints."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from router_fixtures import MODEL_DIR, ScriptedBackend, serve

from glmserve.services.router.app import create_app
from glmserve.services.router.backend import RequestHints
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
KEYS = ["key-one", "key-two"]


def key_salt(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> ScriptedBackend:
    return ScriptedBackend(lambda _: tokenizer.encode("ok"), tokenizer)


@pytest.fixture(scope="module")
def urls(backend: ScriptedBackend, tokenizer: Tokenizer):
    open_app = create_app(backend, tokenizer, MODEL, max_context=256)
    keyed_app = create_app(backend, tokenizer, MODEL, api_keys=KEYS, max_context=256)
    with serve(open_app) as open_url, serve(keyed_app) as keyed_url:
        yield open_url, keyed_url


def post(url: str, body: dict, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions"):
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=30)


def last_hints(backend: ScriptedBackend) -> RequestHints | None:
    return backend.hints[-1]


def test_session_from_header_or_user_field(urls, backend: ScriptedBackend) -> None:
    url = urls[0]
    assert post(url, CHAT).status_code == 200
    assert last_hints(backend) == RequestHints(None, None)
    assert post(url, {**CHAT, "user": "u-1"}).status_code == 200
    assert last_hints(backend) == RequestHints("u-1", None)
    assert post(url, {**CHAT, "user": "u-1"}, {"x-session-id": "s-9"}).status_code == 200
    assert last_hints(backend) == RequestHints("s-9", None)  # the header wins
    body = {"model": MODEL, "prompt": "def f", "max_tokens": 2, "user": "u-2"}
    assert post(url, body, {"x-cache-salt": "t1"}, "/v1/completions").status_code == 200
    assert last_hints(backend) == RequestHints("u-2", "t1")


def test_api_keys_are_tenants_and_the_header_only_narrows(urls, backend: ScriptedBackend) -> None:
    url = urls[1]
    for key in KEYS:
        assert post(url, CHAT, {"Authorization": f"Bearer {key}"}).status_code == 200
        assert last_hints(backend) == RequestHints(None, key_salt(KEYS[KEYS.index(key)]))
    headers = {"Authorization": f"Bearer {KEYS[0]}", "x-cache-salt": "team-a"}
    assert post(url, CHAT, headers).status_code == 200
    assert last_hints(backend) == RequestHints(None, key_salt(KEYS[0]) + "/team-a")


@pytest.mark.parametrize("body,headers,param", [
    ({**CHAT, "user": 5}, {}, "user"),
    (CHAT, {"x-session-id": "s" * 300}, "x-session-id"),
    (CHAT, {"x-cache-salt": "s" * 300}, "x-cache-salt"),
])
def test_bad_hints_are_400_and_never_reach_the_backend(urls, backend: ScriptedBackend, body, headers,
                                                       param) -> None:
    n = len(backend.generated)
    r = post(urls[0], body, headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert len(backend.generated) == n
