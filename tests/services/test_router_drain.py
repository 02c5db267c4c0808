"""SIGTERM drain of a real router process (over a fake gRPC worker process), with the real `openai`
client: `/ready` fails and new requests get 503 + Retry-After at once; a stream that ends within
the drain timeout ends normally; what the timeout cuts short ends with an OpenAI error (an SSE
error event then [DONE]; a JSON 503 for a whole answer), never a cut stream or a text/plain 500;
then the router exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from router_process import RouterProcess
from test_router_grpc_backend import start_fake_process, stop_process

from glmserve.text.tokenizer import Tokenizer
from tests.shared import MODEL_DIR

pytestmark = pytest.mark.slow
CHAT = {"model": "glm52-tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def sse_lines(url: str, max_tokens: int, out: list) -> None:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": max_tokens},
                      timeout=30) as resp:
        out.append(resp.status_code)
        out.extend(line for line in resp.iter_lines() if line)


def whole(url: str, max_tokens: int, out: list) -> None:
    out.append(httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens}, timeout=30))


def test_sigterm_drains_then_ends_what_is_left_with_openai_errors(tmp_path: Path) -> None:
    tokens = Tokenizer.from_dir(MODEL_DIR).encode(" hello there" * 100)
    worker, address = start_fake_process(tokens=tokens, delay_s=0.05, with_text=True)
    router = RouterProcess.launch(tmp_path / "router.log", [address], [address], None, "--drain-timeout-s", "2")
    try:
        short, long, body = [], [], []
        threads = [threading.Thread(target=fn, args=(router.url, n, out)) for fn, n, out in
                   ((sse_lines, 10, short), (sse_lines, 150, long), (whole, 150, body))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while router.metrics()["glmserve_router_requests_running", ()] < 3:  # all three stream
            assert time.monotonic() < deadline
            time.sleep(0.05)
        router.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert router.ready().status_code == 503
        with pytest.raises(openai.InternalServerError) as refused:
            openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0).chat.completions.create(
                **CHAT, max_tokens=2, stream=True)
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"]
        for t in threads:
            t.join(20)
        assert short[0] == 200 and short[-1] == "data: [DONE]"
        assert json.loads(short[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert long[0] == 200 and long[-1] == "data: [DONE]"
        error = json.loads(long[-2].removeprefix("data: "))["error"]
        assert error["code"] == "service_unavailable", error
        assert len(long) > 10  # it streamed until the drain timeout, then ended with the error
        assert body[0].status_code == 503 and body[0].headers["content-type"] == "application/json"
        assert body[0].json()["error"]["type"] == "service_unavailable_error"
        assert router.proc.wait(20) == 0
        log = router.log.read_text()
        assert "router drained (2 requests ended by the drain timeout)" in log, log
    finally:
        router.kill()
        stop_process(worker)
