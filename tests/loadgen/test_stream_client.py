"""How the harness reads what a server streams, for answers a healthy glmserve never gives (a
stream cut short, an error event, a malformed chunk, a timeout) and tokens per chunk from logprobs.
The server here is an httpx transport replaying fixed SSE bytes; the real server is in
test_bench_serve_local."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from glmserve.loadgen.request_record import RequestRecord
from glmserve.loadgen.stream_client import CancelRule, StreamClient

USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}


def sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def text(t: str, finish: str | None = None, tokens: int | None = None) -> dict:
    choice = {"index": 0, "text": t, "finish_reason": finish}
    if tokens is not None:
        choice["logprobs"] = {"tokens": ["x"] * tokens}
    return {"choices": [choice]}


def run(body: bytes, status: int = 200, cancel: CancelRule | None = None, timeout_s: float = 30.0,
        delay_s: float = 0.0) -> tuple[RequestRecord, str]:
    async def stream():
        for part in body.split(b"\n\n"):
            await asyncio.sleep(delay_s)
            if part:
                yield part + b"\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream_options"] == {"include_usage": True}
        return httpx.Response(status, content=stream() if status == 200 else body)

    async def go() -> tuple[RequestRecord, str]:
        client = StreamClient("http://server", timeout_s=timeout_s, transport=httpx.MockTransport(handler))
        try:
            record = RequestRecord(id=0)
            out = await client.stream(record, {"model": "m", "prompt": [1, 2]}, cancel=cancel)
            return record, out.text
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_whole_stream_with_tokens_per_chunk_usage_and_tpot() -> None:
    record, out = run(sse(text("a", tokens=1), text("bc", tokens=3), text("d", "length", tokens=1),
                          {"choices": [], "usage": USAGE}, b"[DONE]"))
    assert (record.status, out, record.chunks, record.chunk_tokens) == ("ok", "abcd", 3, [1, 3, 1])
    assert (record.prompt_tokens, record.output_tokens, record.cached_tokens) == (7, 5, 4)
    assert len(record.itl_s) == 2 and record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 4)


@pytest.mark.parametrize("body,kind", [
    (sse(text("a")), "incomplete_stream"),  # cut without [DONE]
    (sse(text("a"), b"[DONE]"), "incomplete_stream"),  # [DONE] without a finish_reason
    (sse(text("a"), {"error": {"message": "boom", "code": 500}}, b"[DONE]"), "stream_error"),
    (sse(b"{not json"), "bad_chunk"),
    (sse({"choices": ["text"]}), "bad_chunk"),
])
def test_broken_streams_are_errors_by_kind(body: bytes, kind: str) -> None:
    record, _ = run(body)
    assert (record.status, record.error_kind) == ("error", kind)


def test_an_http_error_keeps_its_status_and_message() -> None:
    record, _ = run(json.dumps({"error": {"message": "model not found"}}).encode(), status=404)
    assert (record.status, record.error_kind, record.http_status, record.error) == ("error", "http_404", 404,
                                                                                   "model not found")


def test_cancellation_by_chunks_or_seconds_is_not_an_error_but_a_timeout_is() -> None:
    body = sse(*(text("x") for _ in range(10)), text("y", "length"), b"[DONE]")
    record, out = run(body, cancel=CancelRule(after_chunks=3))
    assert (record.status, record.error_kind, record.chunks, out) == ("cancelled", None, 3, "xxx")
    record, _ = run(body, cancel=CancelRule(after_s=0.2), delay_s=0.05)
    assert record.status == "cancelled" and 0 < record.chunks < 11 and record.e2e_s == pytest.approx(0.2, abs=0.1)
    record, _ = run(body, timeout_s=0.2, delay_s=0.05)
    assert (record.status, record.error_kind) == ("error", "timeout")
    record, _ = run(body, cancel=CancelRule(after_chunks=50))  # the stream ended first
    assert record.status == "ok"
