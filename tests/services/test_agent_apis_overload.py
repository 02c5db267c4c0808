"""The agent APIs share the chat path's admission queue: with it full, `/v1/responses` and
`/v1/messages` are refused with 429 and ``Retry-After`` before any byte of a stream, each in its
own API's error shape, and the running request is unharmed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from router_fixtures import HAS_MODEL, MODEL_DIR, ScriptedBackend, serve

from glmserve.services.router.admission import AdmissionConfig
from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"

pytestmark = pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")


def test_a_full_queue_is_429_before_any_stream_byte_in_each_shape():
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    backend = ScriptedBackend(lambda _: tokenizer.encode(" one two three" * 10), tokenizer, delay_s=0.05)
    app = create_app(backend, tokenizer, MODEL, max_context=512,
                     admission=AdmissionConfig(max_running=1, max_queued=1))
    with serve(app) as base:
        answers: list[dict] = []
        bodies = [("/v1/responses", {"model": MODEL, "input": "hi"}),
                  ("/v1/messages", {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]})]
        threads = []
        for (path, body), (counter, n) in zip(bodies, [("running", 1), ("queued", 1)], strict=True):
            threads.append(threading.Thread(target=lambda p=path, b=body: answers.append(
                httpx.post(f"{base}{p}", json=b, timeout=30).json()), daemon=True))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while getattr(app.state.serving.admission, counter) != n:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        responses = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
        messages = httpx.post(f"{base}/v1/messages", json={"model": MODEL, "max_tokens": 5, "stream": True,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        for reply in (responses, messages):
            assert reply.status_code == 429 and int(reply.headers["retry-after"]) >= 1
            assert reply.headers["content-type"] == "application/json"
        assert responses.json()["error"]["code"] == "queue_full"
        assert messages.json() == {"type": "error", "error": {"type": "rate_limit_error",
                                                              "message": messages.json()["error"]["message"]}}
        for thread in threads:
            thread.join(30)
        texts = sorted(a["output"][0]["content"][0]["text"] if "output" in a else a["content"][0]["text"]
                       for a in answers)
        assert texts == [" one two three" * 10] * 2  # the running and the queued one both finished
