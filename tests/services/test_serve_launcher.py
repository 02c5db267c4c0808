"""`glmserve serve`: the launcher's supervision (fast, with fake workers) and the whole platform end
to end with the unmodified `openai` client (slow: real prefill and decode workers on 127.0.0.1)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from router_fixtures import HAS_MODEL, MODEL_DIR

from glmserve.commands.serve import Launcher, LaunchError, ServeConfig, module_exists

REPO = Path(__file__).resolve().parents[2]
FAKE_WORKER = "test_router_grpc_backend"  # that test file, run as a module, is a fake worker
WORKERS_MISSING = [m for m in ("glmserve.services.prefill.main", "glmserve.services.decode.main")
                   if not module_exists(m)]


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(Path(__file__).parent)]))
    launcher = Launcher(ServeConfig(MODEL_DIR, ready_timeout_s=1.0, grace_s=5.0), threading.Event())
    yield launcher
    launcher.stop_all()


def test_a_child_that_dies_is_reported_and_the_rest_are_stopped(launcher: Launcher) -> None:
    a = launcher.start("fake-a", FAKE_WORKER, "--port", "0", metrics=False)
    b = launcher.start("fake-b", FAKE_WORKER, "--port", "0", metrics=False)
    launcher.wait_ready({a: lambda: a.announced, b: lambda: b.announced}, time.monotonic() + 30)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", a.address)
    launcher.check_alive()
    a.proc.kill()
    a.proc.wait(timeout=10)
    with pytest.raises(LaunchError, match="fake-a was killed by SIGKILL"):
        launcher.check_alive()
    launcher.stop_all()
    assert b.exit_status() is not None


def test_a_start_that_takes_too_long_names_the_laggard(launcher: Launcher) -> None:
    slow = launcher.start("never-ready", "http.server", "0", "--bind", "127.0.0.1", metrics=False)
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 1 s waiting for never-ready"):
        launcher.wait_ready({slow: lambda: slow.announced}, time.monotonic() + 1.0)
    assert time.monotonic() - start < 5
    launcher.stop_all()
    assert slow.exit_status() is not None


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        ServeConfig(tmp_path)
    with pytest.raises(ValueError, match="prefill_workers"):
        ServeConfig(MODEL_DIR, prefill_workers=0)
    with pytest.raises(ValueError, match="transfer"):
        ServeConfig(MODEL_DIR, transfer="carrier-pigeon")
    with pytest.raises(ValueError, match="prefill_stages"):
        ServeConfig(MODEL_DIR, prefill_stages=9)  # the bundled model has 8 layers
    with pytest.raises(ValueError, match="prefill_layer_split: 2 ranges for 4 prefill stages"):
        ServeConfig(MODEL_DIR, prefill_stages=4, prefill_layer_split="0-3,4-7")
    assert ServeConfig(MODEL_DIR, prefill_layer_split="0-2,3-7").layer_plan().ranges == (range(0, 3), range(3, 8))


# --- end to end -------------------------------------------------------------------------------------


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")
@pytest.mark.skipif(bool(WORKERS_MISSING), reason=f"worker services not built yet: {WORKERS_MISSING}")
@pytest.mark.parametrize("stages", [1, 2])
def test_serve_answers_the_openai_client_and_stops_every_process(tmp_path: Path, stages: int) -> None:
    """With --prefill-stages 2 the prefill worker is a LayerSplit replica of two processes."""
    cmd = [sys.executable, "-m", "glmserve.cli", "serve", "--model", str(MODEL_DIR),
           "--prefill-workers", "1", "--decode-workers", "1", "--port", "0", "--ready-timeout", "240",
           "--prefill-stages", str(stages)]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    pids: list[int] = []
    planned = False
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None:
            assert proc.poll() is None, f"launcher exited {proc.returncode}: {(tmp_path / 'serve.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "launcher did not print its URL"
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            pids += [int(p) for p in re.findall(r"pid (\d+)", line)]
            planned = planned or "LayerSplit plan (planned): 2 stage(s)" in line
            if m := re.search(r"serving \S+ at (http://\S+/v1)", line):
                url = m.group(1)
        assert len(pids) == 3 + stages  # kvstore, prefill (a process per stage), decode, router
        assert planned == (stages == 2)  # the plan is printed at start

        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What does json/decoder.py do?"}]
        greedy = {"model": MODEL_DIR.name, "messages": messages, "temperature": 0, "max_tokens": 8}
        whole = client.chat.completions.create(**greedy)
        assert whole.choices[0].finish_reason in ("stop", "length")
        assert whole.usage.prompt_tokens > 0 and 1 <= whole.usage.completion_tokens <= 8
        assert whole.usage.prompt_tokens_details.cached_tokens >= 0

        chunks = list(client.chat.completions.create(
            **greedy, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content  # greedy: the same tokens either way
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while _pids_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pids_alive(pids) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in _pids_alive(pids):
            os.kill(pid, signal.SIGKILL)
        log.close()
