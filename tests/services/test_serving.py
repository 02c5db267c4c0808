"""The serving layer without HTTP: `OpenAIServing` answers a parsed body, given only what a transport
knows (`RequestContext`); the HTTP routes add nothing but framing."""

from __future__ import annotations

import asyncio
import json
import time

from router_fixtures import ScriptedBackend

from glmserve.services.router.backend import RequestHints
from glmserve.services.router.metrics import RouterMetrics
from glmserve.services.router.openai_requests import ChatCompletionRequest, CompletionRequest, parse_body
from glmserve.services.router.request_run import RequestContext
from glmserve.services.router.serving import OpenAIServing


def _serving(tokenizer, delay_s: float = 0.0) -> tuple[OpenAIServing, ScriptedBackend]:
    backend = ScriptedBackend(lambda _: tokenizer.encode("one two three"), tokenizer, delay_s)
    return OpenAIServing(backend, tokenizer, "m", 512, RouterMetrics("m")), backend


def _context(gone: asyncio.Event | None = None) -> RequestContext:
    async def disconnected() -> None:
        await (gone or asyncio.Event()).wait()

    return RequestContext(time.monotonic(), "/v1/chat/completions", RequestHints(), disconnected)


def _chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **fields}
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


def test_a_whole_chat_answer(tokenizer):
    serving, backend = _serving(tokenizer)
    answer = asyncio.run(serving.chat(_chat(max_tokens=10), _context()))
    choice = answer.body["choices"][0]
    assert answer.status == 200 and choice["message"]["content"] == "one two three"
    assert choice["finish_reason"] == "stop" and answer.body["usage"]["completion_tokens"] == 3
    assert backend.generated[0][1] == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_streamed_completion_with_usage(tokenizer):
    serving, _ = _serving(tokenizer)
    body = parse_body(CompletionRequest, b'{"model": "m", "prompt": "x", "stream": true, "max_tokens": 2,'
                                         b' "stream_options": {"include_usage": true}}')

    async def chunks():
        answer = await serving.completion(body, _context())
        return [c async for c in answer.chunks]

    out = asyncio.run(chunks())
    assert "".join(c["choices"][0]["text"] for c in out if c["choices"]) == "one two"
    assert out[-2]["choices"][0]["finish_reason"] == "length" and out[-1]["usage"]["completion_tokens"] == 2


def test_a_client_that_leaves_aborts_the_request(tokenizer):
    serving, backend = _serving(tokenizer, delay_s=0.2)

    async def leave():
        gone = asyncio.Event()
        task = asyncio.ensure_future(serving.chat(_chat(max_tokens=10), _context(gone)))
        await asyncio.sleep(0.05)
        gone.set()
        return await task

    answer = asyncio.run(leave())
    assert answer.status == 499 and answer.body is None and backend.aborted
