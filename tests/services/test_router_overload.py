"""Overload that says what it is, over real HTTP with the real `openai` client: a full admission
queue or a spent queue wait is a 429, no healthy worker or a drain a 503, each with `Retry-After`
and each before any byte of a stream; every decode worker being full means "wait", not 503."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
from router_fixtures import MODEL_DIR, ScriptedBackend, serve

from glmserve.services.router.admission import AdmissionConfig
from glmserve.services.router.app import create_app
from glmserve.services.router.backend import BackendFull, BackendUnavailable
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


class Backend(ScriptedBackend):
    """Slow tokens; the first ``full_for`` generate calls find every worker full, or (``down``)
    find none healthy."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(lambda _: tokenizer.encode("one two three"), tokenizer, delay_s=0.15)
        self.full_for, self.down = 0, False

    async def generate(self, request_id, prompt_ids, params, hints=None):
        if self.down:
            raise BackendUnavailable("no healthy decode worker")
        if self.full_for > 0:
            self.full_for -= 1
            raise BackendFull("every decode worker is full")
        async for event in super().generate(request_id, prompt_ids, params, hints):
            yield event


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture()
def platform(tokenizer, request):
    """(base URL, backend, app) of a router whose queue admits 1 running and 1 waiting request."""
    backend = Backend(tokenizer)
    config = AdmissionConfig(max_running=1, max_queued=1, max_wait_s=getattr(request, "param", 5.0),
                             capacity_poll_s=0.05)
    app = create_app(backend, tokenizer, MODEL, max_context=256, admission=config)
    with serve(app) as base:
        yield base, backend, app


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)


def in_background(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def rejections(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("glmserve_router_rejections_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def wait_queued(app, n: int) -> None:
    deadline = time.monotonic() + 10
    while app.state.serving.admission.queued != n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_full_queue_is_429_before_any_byte_of_a_stream(platform):
    base, backend, app = platform
    backend.delay_s = 0.05
    backend.script = lambda _: backend.tokenizer.encode(" one two three" * 20)  # 3 s of tokens each
    chat = {**CHAT, "max_tokens": 200}
    answers: list[str] = []
    first = in_background(lambda: answers.append(
        client(base).chat.completions.create(**chat).choices[0].message.content))
    while app.state.serving.admission.running != 1:
        time.sleep(0.01)
    second = in_background(lambda: answers.append(
        client(base).chat.completions.create(**chat).choices[0].message.content))
    wait_queued(app, 1)
    with pytest.raises(openai.RateLimitError) as refused:  # raised by create(): no chunk was sent
        client(base).chat.completions.create(**CHAT, stream=True)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.response.headers["content-type"] == "application/json"
    assert refused.value.code == "queue_full"
    first.join(20), second.join(20)
    assert answers == [" one two three" * 20] * 2  # the queued one ran once the first ended
    assert rejections(base)["queue_full"] == 1.0


@pytest.mark.parametrize("platform", [0.3], indirect=True)
def test_a_spent_queue_wait_is_429(platform):
    base, backend, app = platform
    backend.script = lambda _: [backend.tokenizer.encode(" a")[0]] * 40  # 6 s of tokens
    first = in_background(lambda: client(base).completions.create(model=MODEL, prompt="x", max_tokens=40))
    while app.state.serving.admission.running != 1:
        time.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as refused:
        client(base).completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True)
    assert refused.value.code == "queue_timeout" and 0.25 < time.monotonic() - started < 5
    assert app.state.serving.admission.queued == 0
    first.join(15)


def test_full_decode_workers_mean_wait_not_unavailable(platform):
    base, backend, _ = platform
    backend.full_for = 4  # four tries find every worker full, the fifth runs
    chunks = list(client(base).chat.completions.create(**CHAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three"
    assert backend.full_for == 0 and rejections(base)["no_worker"] == 0.0


@pytest.mark.parametrize("platform", [0.3], indirect=True)
def test_workers_full_past_the_queue_wait_is_429(platform):
    base, backend, _ = platform
    backend.full_for = 10**6
    with pytest.raises(openai.RateLimitError) as refused:
        client(base).chat.completions.create(**CHAT, stream=True)
    assert refused.value.code == "queue_timeout"


def test_no_healthy_worker_and_draining_are_503_before_any_byte(platform):
    base, backend, app = platform
    for down in ("not ready", "refused at start"):
        backend.is_ready, backend.down = down != "not ready", down == "refused at start"
        with pytest.raises(openai.InternalServerError) as refused:
            client(base).chat.completions.create(**CHAT, stream=True)
        assert refused.value.status_code == 503 and int(refused.value.response.headers["retry-after"]) >= 1
    backend.is_ready, backend.down = True, False
    app.state.serving.admission.drain()
    with pytest.raises(openai.InternalServerError) as refused:
        client(base).chat.completions.create(**CHAT, stream=True)
    assert refused.value.status_code == 503 and refused.value.code == "draining"
    assert rejections(base)["no_worker"] == 2.0 and rejections(base)["draining"] == 1.0


def test_a_queued_request_whose_client_left_is_dropped_at_once(platform):
    base, backend, app = platform
    first = in_background(lambda: client(base).chat.completions.create(**CHAT))
    while app.state.serving.admission.running != 1:
        time.sleep(0.01)

    async def leave() -> None:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as c:
            task = asyncio.ensure_future(c.chat.completions.create(**CHAT))
            await asyncio.to_thread(wait_queued, app, 1)
            task.cancel()  # the client closes its connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave())
    wait_queued(app, 0)  # gone before the running request ended
    assert app.state.serving.admission.running == 1
    first.join(10)
    assert len(backend.generated) == 1 and rejections(base)["gone"] == 1.0
