"""`glmserve bench` against a real `glmserve serve-local` process on 127.0.0.1 (the tiny model):
replay and agent runs give reports with the right counts and exact cache hits, a cancelled
request counts as cancelled and reaches the server as a disconnect, an HTTP error is counted by
kind, the harness reads a stream as the `openai` client does, and `compare` reads two runs."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from glmserve.cli import main
from glmserve.loadgen.request_record import RequestRecord, read_jsonl
from glmserve.loadgen.server_metrics import metrics_delta
from glmserve.loadgen.stream_client import StreamClient
from tests.shared import MODEL_DIR, REPO, free_port, requires_model

MODEL = MODEL_DIR
pytestmark = requires_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve-local") / "log.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "glmserve.cli", "serve-local", "--port", str(port),
                                 "--host", "127.0.0.1", "--mtp", "off"], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"serve-local did not start:\n{log.read_text()}")
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def trace(tmp_path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                            for t, i, o, h in rows))
    return path


def requests_answered(delta: dict[str, float], status: str) -> float:
    """Router requests answered with ``status``, over every other label (endpoint, model_name)."""
    return sum(v for k, v in delta.items()
               if k.startswith("glmserve_router_requests_total{") and f'status="{status}"' in k)


def bench(*args: str) -> int:
    return main(["bench", *args, "--no-progress"])


def test_replay_reports_the_right_counts_and_exact_cache_hits(server: str, tmp_path: Path) -> None:
    # 32 tokens a block: 96 shared tokens hold one whole 64-token KV block of serve-local's cache.
    path = trace(tmp_path, [(0, 1536, 4, [1, 2, 3]), (10, 1800, 3, [1, 2, 3, 4]), (20, 700, 9, [7, 8])])
    out = tmp_path / "run"
    assert bench("replay", str(path), "--url", f"{server}/v1", "--out", str(out), "--tokens-per-block", "32",
                 "--max-output-tokens", "4", "--concurrency", "1", "--time-scale", "0", "--metrics",
                 "--slo", "ttft=600") == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["requests"], report["completed"], report["errors"], report["cancelled"]) == (3, 3, 0, 0)
    assert report["command"].startswith("glmserve bench replay") and "--tokens-per-block 32" in report["command"]
    records = sorted(read_jsonl(out / "requests.jsonl"), key=lambda r: r.id)
    assert [(r.prompt_tokens_sent, r.prompt_tokens, r.output_tokens) for r in records] == [
        (96, 96, 4), (96 + 17, 113, 3), (32 + 12, 44, 4)]
    assert [r.cached_tokens for r in records] == [0, 64, 0]
    assert report["cached_token_ratio"] == pytest.approx(64 / (96 + 113 + 44))
    assert report["output_tokens"] == 11 and report["output_tokens_per_s"] > 0
    for r in records:
        assert r.status == "ok" and r.finish_reason == "length" and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == r.chunks - 1 and r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (r.output_tokens - 1))
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert report[key]["p50"] <= report[key]["p90"] <= report[key]["p99"]
    assert report["goodput_fraction"] == 1.0
    assert requests_answered(report["server_metrics_delta"], "200") == 3
    assert (out / "metrics_before.txt").is_file() and "data:image/png;base64" in (out / "report.html").read_text()


def test_a_cancelled_request_is_cancelled_not_an_error(server: str, tmp_path: Path) -> None:
    path = trace(tmp_path, [(0, 512, 200, [40])])
    out = tmp_path / "cancel"
    assert bench("replay", str(path), "--url", server, "--out", str(out), "--tokens-per-block", "8",
                 "--cancel-after-chunks", "2", "--metrics") == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["requests"], report["completed"], report["errors"], report["cancelled"]) == (1, 0, 0, 1)
    [record] = read_jsonl(out / "requests.jsonl")
    assert (record.status, record.error_kind, record.chunks) == ("cancelled", None, 2)
    # The server saw the client go (499) before its 200 tokens were done.
    deadline = time.monotonic() + 30
    while requests_answered(metrics_delta("", httpx.get(f"{server}/metrics").text), "499") < 1:
        assert time.monotonic() < deadline, "the server never counted the cancelled request as a 499"
        time.sleep(0.2)


def test_http_errors_are_counted_by_kind(server: str, tmp_path: Path) -> None:
    path = trace(tmp_path, [(0, 100, 2, [1]), (0, 100, 2, [2])])
    out = tmp_path / "errors"
    assert bench("replay", str(path), "--url", server, "--model", "no-such-model", "--out", str(out),
                 "--tokens-per-block", "8") == 1
    report = json.loads((out / "report.json").read_text())
    assert (report["errors"], report["errors_by_kind"], report["completed"]) == (2, {"http_404": 2}, 0)


@pytest.mark.slow  # several runs or multi-turn sessions
def test_agent_sessions_grow_hold_their_session_and_hit_the_cache(server: str, tmp_path: Path) -> None:
    out = tmp_path / "agent"
    assert bench("agent", "--url", server, "--out", str(out), "--sessions", "2", "--turns", "3", "--tools", "2",
                 "--system-tokens", "60", "--repo-tokens", "100", "--tool-result-tokens", "40",
                 "--max-output-tokens", "3", "--think-s", "0.05", "--tool-wait-s", "0.05",
                 "--follow-up-fraction", "0") == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["requests"], report["completed"], report["errors"]) == (6, 6, 0)
    records = read_jsonl(out / "requests.jsonl")
    for session in ("s0", "s1"):
        turns = sorted((r for r in records if r.session == session), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        lengths = [r.prompt_tokens for r in turns]
        assert lengths == sorted(lengths) and lengths[0] < lengths[-1]  # context grows turn by turn
        assert all(r.cached_tokens >= 64 for r in turns[1:])  # each turn reuses the previous one's KV
    assert set(report["cached_token_ratio_by_turn"]) == {"0", "1", "2"}


def test_the_harness_reads_a_stream_as_the_openai_client_does(server: str) -> None:
    body = {"model": "glm52-tiny", "messages": [{"role": "user", "content": "def add(a, b):"}],
            "max_tokens": 12, "temperature": 0.0}
    reference = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    chunks = list(reference.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage

    async def ours() -> tuple[RequestRecord, str]:
        client = StreamClient(server)
        try:
            record = RequestRecord(id=0, endpoint="chat")
            out = await client.stream(record, body)
            return record, out.text
        finally:
            await client.aclose()

    record, our_text = asyncio.run(ours())
    assert our_text == text
    assert (record.prompt_tokens, record.output_tokens, record.status) == (usage.prompt_tokens,
                                                                          usage.completion_tokens, "ok")
    assert record.cached_tokens == usage.prompt_tokens_details.cached_tokens
    assert record.chunks == sum(1 for c in chunks if c.choices and c.choices[0].delta.content)


@pytest.mark.slow  # several runs or multi-turn sessions
def test_text_prompts_over_chat_a_rate_sweep_and_input_caps(server: str, tmp_path: Path) -> None:
    path = trace(tmp_path, [(0, 600, 2, [1, 2]), (0, 600, 2, [1, 2])])
    out = tmp_path / "sweep"
    assert bench("replay", str(path), "--url", server, "--out", str(out), "--endpoint", "chat", "--prompt-format",
                 "text", "--tokens-per-block", "8", "--rate", "20,40", "--concurrency", "1") == 0
    report = json.loads((out / "report.json").read_text())
    assert [(s["label"], s["requests"], s["completed"]) for s in report["sections"]] == [("20/s", 2, 2), ("40/s", 2, 2)]
    assert report["requests"] == 4 and all(r.endpoint == "chat" and r.prompt_tokens > 8 for r in read_jsonl(out / "requests.jsonl"))
    capped = tmp_path / "capped"
    assert bench("replay", str(path), "--url", server, "--out", str(capped), "--max-input-tokens", "10",
                 "--max-requests", "1") == 0
    [record] = read_jsonl(capped / "requests.jsonl")
    assert (record.prompt_tokens_sent, record.prompt_tokens, record.output_tokens) == (10, 10, 2)
    assert bench("replay", str(path), "--url", server, "--out", str(tmp_path / "x"), "--endpoint", "chat") == 2


@pytest.mark.slow  # several runs or multi-turn sessions
def test_compare_prints_and_plots_two_runs(server: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = trace(tmp_path, [(0, 600, 2, [1, 2]), (0, 600, 2, [1, 2])])
    for name in ("a", "b"):
        assert bench("replay", str(path), "--url", server, "--out", str(tmp_path / name), "--tokens-per-block", "8",
                     "--concurrency", "1", "--seed", "1" if name == "a" else "2") == 0
    capsys.readouterr()
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--html", str(tmp_path / "c.html")]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "requests" in printed and " a " in printed.splitlines()[0] + " "
    assert (tmp_path / "c.html").read_text().count("data:image/png") == 4
