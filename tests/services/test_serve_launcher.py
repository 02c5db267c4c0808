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

from glmserve.commands.child import ChildSpec
from glmserve.commands.free_ports import free_ports
from glmserve.commands.serve import ServeConfig, module_exists, plan
from glmserve.commands.supervisor import GaveUp, RestartPolicy, Supervisor

REPO = Path(__file__).resolve().parents[2]
FAKE_WORKER = "test_router_grpc_backend"  # that test file, run as a module, is a fake worker
WORKERS_MISSING = [m for m in ("glmserve.services.prefill.main", "glmserve.services.decode.main")
                   if not module_exists(m)]


def _fake(name: str, port: int, rank: int = 1, *extra: str) -> ChildSpec:
    return ChildSpec(name, "fake", (sys.executable, "-m", FAKE_WORKER, "--port", str(port), *extra),
                     f"127.0.0.1:{port}", stop_rank=rank)


def _python(name: str, code: str, rank: int = 1) -> ChildSpec:
    return ChildSpec(name, "script", (sys.executable, "-c", code), name, stop_rank=rank)


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(Path(__file__).parent)]))
    said: list[str] = []
    policy = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=0.4, max_restarts=2, stable_after_s=60)
    sup = Supervisor(policy, dict(os.environ), lambda message, _err: said.append(message), threading.Lock())
    sup.said = said
    yield sup
    sup.stop_all(grace_s=5.0)


def _watch_until(sup: Supervisor, done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, sup.said
        sup.watch()
        time.sleep(0.05)


def test_a_child_that_dies_comes_back_alone_on_its_address(supervisor: Supervisor) -> None:
    port_a, port_b = free_ports("127.0.0.1", 2)
    supervisor.start(_fake("fake-a", port_a))
    b = supervisor.start(_fake("fake-b", port_b))
    supervisor.wait_ready(["fake-a", "fake-b"], time.monotonic() + 30, threading.Event(), 30)
    first = supervisor.process("fake-a")
    assert first.announced_address == f"127.0.0.1:{port_a}"
    first.proc.kill()
    _watch_until(supervisor, lambda: supervisor.process("fake-a") not in (None, first)
                 and supervisor.is_ready("fake-a"))
    assert supervisor.process("fake-a").announced_address == f"127.0.0.1:{port_a}"  # same address
    assert supervisor.process("fake-b") is b and b.exit_status() is None  # the other never stopped
    assert supervisor.restarts() == {"fake-a": 1, "fake-b": 0}
    assert any("fake-a was killed by SIGKILL; restarting it" in m for m in supervisor.said)
    assert any(m == f"fake-a is back at 127.0.0.1:{port_a}" for m in supervisor.said)


def test_a_crash_loop_gives_up_loudly(supervisor: Supervisor) -> None:
    supervisor.start(_python("crasher", "raise SystemExit(3)"))
    keeper = supervisor.start(_python("keeper", "import time; time.sleep(60)"))
    start = time.monotonic()
    with pytest.raises(GaveUp, match="crasher exited with status 3 after 2 restarts in a row"):
        _watch_until(supervisor, lambda: False)
    assert time.monotonic() - start < 10  # backoff 0.1 s, then 0.2 s
    assert supervisor.restarts()["crasher"] == 2
    supervisor.stop_all(grace_s=5.0)
    assert keeper.exit_status() is not None


def test_each_run_is_told_how_often_it_was_restarted(supervisor: Supervisor, tmp_path: Path) -> None:
    """GLMSERVE_RESTARTS: where the child's glmserve_process_restarts_total starts."""
    runs = tmp_path / "runs"
    supervisor.start(_python("counted", f"import os; open({str(runs)!r}, 'a').write(os.environ['GLMSERVE_RESTARTS'] + ' ');"
                                        " raise SystemExit(3)"))
    with pytest.raises(GaveUp):
        _watch_until(supervisor, lambda: False)
    assert runs.read_text().split() == ["0", "1", "2"]


def test_a_stable_run_starts_the_count_over(supervisor: Supervisor) -> None:
    now = [0.0]
    supervisor._clock = lambda: now[0]  # the supervisor's time; processes run in real time
    supervisor.start(_python("flaky", "import time; print('READY flaky', flush=True); time.sleep(60)"))
    for _ in range(4):  # more deaths than max_restarts, each after a stable run
        _watch_until(supervisor, lambda: supervisor.is_ready("flaky"))
        now[0] += 61.0
        supervisor.watch()  # stable now: the count starts over
        proc = supervisor.process("flaky")
        proc.kill()
        _watch_until(supervisor, lambda p=proc: supervisor.process("flaky") is not p)
        now[0] += 1.0  # past the backoff
    assert supervisor.restarts()["flaky"] == 3  # 4 deaths, max_restarts 2: never gave up


def test_stop_ranks_stop_in_order(supervisor: Supervisor, tmp_path: Path) -> None:
    record = ("import signal, sys, time; p = sys.argv[1] if len(sys.argv) > 1 else None\n"
              "def bye(*_):\n    open({path!r}, 'a').write(f'{name} term {{time.time()}}\\n'); time.sleep(0.3)\n"
              "    open({path!r}, 'a').write(f'{name} exit {{time.time()}}\\n'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye); print('READY x', flush=True); time.sleep(60)")
    log = tmp_path / "order.log"
    for name, rank in (("kv", 2), ("worker", 1), ("router", 0)):
        supervisor.start(_python(name, record.format(path=str(log), name=name), rank))
    supervisor.wait_ready(["kv", "worker", "router"], time.monotonic() + 30, threading.Event(), 30)
    supervisor.stop_all(grace_s=5.0)
    events = [line.split()[:2] for line in log.read_text().splitlines()]
    assert events == [["router", "term"], ["router", "exit"], ["worker", "term"], ["worker", "exit"],
                      ["kv", "term"], ["kv", "exit"]]


def test_a_start_that_takes_too_long_names_the_laggard(supervisor: Supervisor) -> None:
    supervisor.start(_python("never-ready", "import time; time.sleep(60)"))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 1 s waiting for never-ready"):
        supervisor.wait_ready(["never-ready"], time.monotonic() + 1.0, threading.Event(), 1.0)
    assert time.monotonic() - start < 5


def test_the_plan_fixes_every_port_on_the_host() -> None:
    specs = plan(ServeConfig(MODEL_DIR, prefill_workers=2, decode_workers=2, port=0))
    assert [s.name for s in specs] == ["kvstore", "prefill-0", "prefill-1", "decode-0", "decode-1", "router"]
    ports = [int(s.address.rsplit(":", 1)[1]) for s in specs] + [s.metrics_port for s in specs if s.metrics_port]
    assert len(set(ports)) == len(ports) == 11
    assert all(s.address.removeprefix("http://").startswith("127.0.0.1:") for s in specs)
    router = specs[-1].argv
    assert router[router.index("--prefill") + 1] == ",".join(s.address for s in specs[1:3])
    assert router[router.index("--decode") + 1] == ",".join(s.address for s in specs[3:5])
    assert router[router.index("--reasoning-parser") + 1] == "glm45"
    assert [s.stop_rank for s in specs] == [2, 1, 1, 1, 1, 0]
    for s in specs[1:5]:
        assert s.argv[s.argv.index("--port") + 1] == s.address.rsplit(":", 1)[1]
    fixed = plan(ServeConfig(MODEL_DIR, prefill_workers=2, decode_workers=2, metrics_port_base=9100))
    assert [s.metrics_port for s in fixed] == [9100, 9101, 9102, 9103, 9104, None]  # kept on every restart
    staged = plan(ServeConfig(MODEL_DIR, prefill_workers=2, decode_workers=1, prefill_stages=2, metrics_port_base=9100))
    # every stage has its metrics: the heads at the workers' ports, stages 1.. after the decode workers
    assert [(s.name, s.metrics_port) for s in staged] == [
        ("kvstore", 9100), ("prefill-0", 9101), ("prefill-0.s1", 9104), ("prefill-1", 9102), ("prefill-1.s1", 9105),
        ("decode-0", 9103), ("router", None)]
    assert all(s.argv[s.argv.index("--metrics-port") + 1] == str(s.metrics_port) for s in staged[:-1])
    free = [s.metrics_port for s in plan(ServeConfig(MODEL_DIR, prefill_stages=2))][:-1]
    assert None not in free and len(set(free)) == 4  # free ports, distinct
    # every worker process (LayerSplit stages too) gets the same --mtp: it sets the KV layout they share
    off = plan(ServeConfig(MODEL_DIR, prefill_workers=1, decode_workers=1, prefill_stages=2, mtp="off"))
    assert [s.argv[s.argv.index("--mtp") + 1] for s in off if s.role in ("prefill", "decode")] == ["off"] * 3
    assert all("--mtp" not in s.argv for s in off if s.role not in ("prefill", "decode"))
    # the decode workers' step budget reaches them alone; without it they keep their own default
    budget = plan(ServeConfig(MODEL_DIR, prefill_workers=1, decode_workers=2, decode_step_tokens=512))
    assert [s.argv[s.argv.index("--max-step-tokens") + 1] for s in budget if "--max-step-tokens" in s.argv] == ["512"] * 2
    assert all(s.role == "decode" for s in budget if "--max-step-tokens" in s.argv)
    assert all("--max-step-tokens" not in s.argv for s in specs)
    # how many prompt tokens prompts may share a step with reaches every worker process, stages too
    shared = plan(ServeConfig(MODEL_DIR, prefill_workers=1, decode_workers=1, prefill_stages=2, shared_prompt_tokens=256))
    assert [(s.role, s.argv[s.argv.index("--shared-prompt-tokens") + 1]) for s in shared
            if "--shared-prompt-tokens" in s.argv] == [("prefill", "256")] * 2 + [("decode", "256")]
    assert all("--shared-prompt-tokens" not in s.argv for s in specs)


def test_restart_policy_backs_off_and_checks_its_fields() -> None:
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0)
    assert [policy.backoff_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


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
    with pytest.raises(ValueError, match="drain_timeout_s"):
        ServeConfig(MODEL_DIR, drain_timeout_s=-1)
    with pytest.raises(ValueError, match="mtp"):
        ServeConfig(MODEL_DIR, mtp="sometimes")
    with pytest.raises(ValueError, match="decode_step_tokens"):
        ServeConfig(MODEL_DIR, decode_step_tokens=0)
    with pytest.raises(ValueError, match="shared_prompt_tokens"):
        ServeConfig(MODEL_DIR, shared_prompt_tokens=0)


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
    """With --prefill-stages 2 the prefill worker is a LayerSplit replica of two processes; that run
    also turns MTP off (every worker's KV layout without the MTP layer)."""
    cmd = [sys.executable, "-m", "glmserve.cli", "serve", "--model", str(MODEL_DIR),
           "--prefill-workers", "1", "--decode-workers", "1", "--port", "0", "--ready-timeout", "240",
           "--prefill-stages", str(stages), *(["--mtp", "off"] if stages == 2 else [])]
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
