"""kill -9 of each role under `glmserve serve`, with streams in flight (the real `openai` client).

One launcher (kvstore, a prefill worker, two decode workers, the router; NIXL where it imports)
for the module. For each role: streams run, the role's process is killed with SIGKILL; the
streams finish with exactly the text of an unloaded run (greedy): those on a killed decode worker
resume on the other one (stream migration: a pause, not an error, with the original usage and
logprobs); only the router's own death ends its streams. The launcher restarts the process on the
same address and the platform serves again; requests sent all along a restart are served or get a
503 with Retry-After, never a 500. The launcher never stops on its own.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from listening_sockets import listening_addresses, non_loopback
from worker_fixtures import HAS_MODEL, MODEL_DIR

from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc
from tests.serve_platform import ServePlatform

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")]



class Platform(ServePlatform):
    """The launcher of this module: one prefill and two decode workers."""

    def __init__(self, log: Path) -> None:
        self.log_path = log
        super().__init__(log, "--ready-timeout", "300", "--drain-timeout", "5", "--host-tier-bytes", str(32 << 20),
                         prefill=1, decode=2, env={"OMP_NUM_THREADS": "1"})
        self.wait_serving()

    def running(self, name: str) -> int:
        with grpc.insecure_channel(self.addresses[name]) as channel:
            return decode_grpc.DecodeStub(channel).Health(decode_pb.HealthRequest(), timeout=5).running


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    p = Platform(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield p
    finally:
        assert p.stop() == 0


@dataclass
class Result:
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: Exception | None = None
    ended_at: float = 0.0
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens
    logprob_tokens: list[str] = field(default_factory=list)  # the token of each logprob entry


async def _stream(client: openai.AsyncOpenAI, content: str, max_tokens: int, out: Result) -> Result:
    try:
        stream = await client.chat.completions.create(
            model=MODEL_DIR.name, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=1,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                out.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            if chunk.choices:
                delta = chunk.choices[0].delta.content or ""
                out.text += delta
                out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
                out.chunks += bool(delta)  # tokens, not the role chunk that precedes them
                logprobs = chunk.choices[0].logprobs
                out.logprob_tokens += [lp.token for lp in (logprobs.content or [])] if logprobs else []
    except (openai.APIError, httpx.HTTPError) as e:
        out.error = e
    out.ended_at = time.monotonic()
    return out


def _client(platform: Platform) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{platform.url}/v1", api_key="unused", max_retries=0, timeout=120)


async def _run_and_kill(platform: Platform, prompts: list[str], max_tokens: int, victim: str,
                        when: Callable[[list[Result]], bool]) -> tuple[list[Result], float]:
    partial = [Result() for _ in prompts]
    async with _client(platform) as client:
        tasks = [asyncio.ensure_future(_stream(client, p, max_tokens, r)) for p, r in zip(prompts, partial, strict=True)]
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(when, partial):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks), partial
            await asyncio.sleep(0.02)
        killed = platform.kill(victim)
        return await asyncio.gather(*tasks), killed


async def _solo(platform: Platform, prompts: list[str], max_tokens: int) -> list[Result]:
    async with _client(platform) as client:
        return [await _stream(client, p, max_tokens, Result()) for p in prompts]


def _back(platform: Platform, name: str) -> None:
    platform.expect(rf"glmserve: {re.escape(name)} is back at", timeout_s=300)
    _healthy_again(platform)


def _healthy_again(platform: Platform) -> None:
    deadline = time.monotonic() + 60
    while not _all_healthy(platform):
        assert time.monotonic() < deadline, platform.ready()
        time.sleep(0.2)


def _all_healthy(platform: Platform) -> bool:
    try:
        r = platform.ready()
    except httpx.HTTPError:
        return False
    counts = r.get("workers", {})
    whole = all(c["healthy"] == c["total"] for c in counts.values()) and len(counts) == 2
    return r.get("status") == "ready" and r.get("prefix_index") == "kvstore" and whole


def test_every_listener_of_every_service_is_on_loopback(platform: Platform) -> None:
    """DESIGN invariant 9, for the whole platform: gRPC, HTTP, metrics and KV transfer (NIXL/UCX or
    TCP) listeners of every child bind 127.0.0.1 only."""
    assert set(platform.pids) == {"kvstore", "prefill-0", "decode-0", "decode-1", "router"}
    asyncio.run(_solo(platform, PROMPTS[:1], 4))  # transfers have happened: every listener is open
    for name, pid in platform.pids.items():
        opened = listening_addresses(pid)
        assert opened and not non_loopback(opened), (name, opened)


PROMPTS = [f"Explain item {i} of the list in json/decoder.py." for i in range(6)]


def test_decode_worker_killed_mid_stream_its_streams_resume_on_the_other(platform: Platform) -> None:
    """Stream migration: the streams on the killed decode worker go on on the other one (through
    prefill again with prompt + the tokens sent); every stream is the unloaded run's, text, usage
    and logprob tokens, and none sees an error."""
    # 150 tokens: long enough that no stream ends before every stream has started (80 could, when
    # decode-0's streams finished while a prompt still waited for its prefill)
    reference = asyncio.run(_solo(platform, PROMPTS, 150))
    both_busy = lambda rs: all(r.chunks for r in rs) and platform.running("decode-0") > 0  # noqa: E731
    results, _ = asyncio.run(_run_and_kill(platform, PROMPTS, 150, "decode-0", both_busy))
    # Until it is back, /ready says one decode worker of two is healthy, and still serves.
    assert platform.ready()["workers"]["decode"] == {"healthy": 1, "total": 2}
    for r, ref in zip(results, reference, strict=True):
        assert (r.error, r.finish_reason, r.text, r.usage) == (None, "length", ref.text, ref.usage)
        assert r.logprob_tokens == ref.logprob_tokens and len(r.logprob_tokens) == 150
    assert "resuming after" in platform.log_path.read_text()  # some were on decode-0
    _back(platform, "decode-0")
    assert [r.text for r in asyncio.run(_solo(platform, PROMPTS[:2], 150))] == [r.text for r in reference[:2]]


def test_prefill_worker_killed_streams_already_decoding_finish(platform: Platform) -> None:
    reference = asyncio.run(_solo(platform, PROMPTS, 150))  # long enough: all decode at once
    results, killed = asyncio.run(_run_and_kill(platform, PROMPTS, 150, "prefill-0",
                                                lambda rs: all(r.chunks for r in rs)))
    for r, ref in zip(results, reference, strict=True):  # decode needs no prefill worker any more
        assert (r.error, r.finish_reason, r.text) == (None, "length", ref.text)
    _back(platform, "prefill-0")
    assert asyncio.run(_solo(platform, PROMPTS[:1], 150))[0].text == reference[0].text


def test_requests_while_a_worker_restarts_are_served_or_503_never_500(platform: Platform) -> None:
    """Requests sent all along a prefill worker's restart: while it is down (503 + Retry-After) and
    right after it is back, while the decode workers' channels to it still reconnect (then the router
    tries again within the queue wait): never a 500, and every answer is the unloaded run's."""
    body = {"model": MODEL_DIR.name, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8,
            "temperature": 0}
    reference = httpx.post(f"{platform.url}/v1/chat/completions", json=body, timeout=60).json()
    answers: list[tuple[float, int, dict]] = []
    stop = threading.Event()

    def ask_all_along() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                r = client.post(f"{platform.url}/v1/chat/completions", json=body)
                answers.append((time.monotonic(), r.status_code, {**r.json(), "retry-after": r.headers.get("retry-after")}))

    asker = threading.Thread(target=ask_all_along, daemon=True)
    asker.start()
    time.sleep(0.5)
    platform.kill("prefill-0")
    platform.expect(r"glmserve: prefill-0 is back at", timeout_s=300)
    back = time.monotonic()
    time.sleep(5)
    stop.set()
    asker.join(60)
    assert {status for _, status, _ in answers} <= {200, 503}, [a for a in answers if a[1] not in (200, 503)]
    for _, status, answer in answers:
        if status == 200:
            assert answer["choices"][0]["message"] == reference["choices"][0]["message"]
        else:
            assert int(answer["retry-after"]) >= 1 and answer["error"]["type"]
    assert any(status == 200 and at > back for at, status, _ in answers)
    _healthy_again(platform)


def test_kvstore_killed_nothing_fails_and_the_index_comes_back(platform: Platform) -> None:
    reference = asyncio.run(_solo(platform, PROMPTS, 60))
    results, _ = asyncio.run(_run_and_kill(platform, PROMPTS, 60, "kvstore", lambda rs: any(r.chunks for r in rs)))
    for r, ref in zip(results, reference, strict=True):  # the kvstore is not on the data path
        assert (r.error, r.finish_reason, r.text) == (None, "length", ref.text)
    _back(platform, "kvstore")  # includes /ready's prefix_index back on "kvstore"
    again = asyncio.run(_solo(platform, PROMPTS[:1], 60))[0]
    assert again.text == reference[0].text


def test_router_killed_comes_back_on_its_port(platform: Platform) -> None:
    url = platform.url
    reference = asyncio.run(_solo(platform, PROMPTS[:2], 40))
    results, killed = asyncio.run(_run_and_kill(platform, PROMPTS[:2], 400, "router",
                                                lambda rs: all(r.chunks for r in rs)))
    assert all(r.error is not None for r in results)  # the router held their connections
    _back(platform, "router")
    assert platform.url == url
    assert [r.text for r in asyncio.run(_solo(platform, PROMPTS[:2], 40))] == [r.text for r in reference]
