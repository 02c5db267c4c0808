"""`glmserve serve` as a subprocess for end-to-end tests, on ports fixed before it starts (a base of
consecutive metrics ports, then the router's HTTP port), so a Prometheus config can name every target
up front. Its stdout lines tell the children's pids and addresses, and restarts."""

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

import httpx

from tests.shared import MODEL_DIR, REPO, free_port_run  # noqa: F401 - re-exported


class ServePlatform:
    """`glmserve serve --port PORT --metrics-port BASE ...` with one line queue of its stdout."""

    def __init__(self, log: Path, *args: str, prefill: int = 1, decode: int = 1, stages: int = 1,
                 env: dict[str, str] | None = None):
        self.prefill, self.decode, self.stages = prefill, decode, stages
        children = 1 + prefill + decode + prefill * (stages - 1)  # kvstore, workers, LayerSplit stages 1..
        self.metrics_base = free_port_run(children + 1)  # then the router's HTTP port
        self.port = self.metrics_base + children
        cmd = [sys.executable, "-m", "glmserve.cli", "serve", "--model", str(MODEL_DIR), "--port", str(self.port),
               "--metrics-port", str(self.metrics_base), "--prefill-workers", str(prefill),
               "--decode-workers", str(decode), "--prefill-stages", str(stages), *args]
        child_env = {**os.environ, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN", **(env or {})}
        self._log = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.pids: dict[str, int] = {}
        self.addresses: dict[str, str] = {}
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics_targets(self) -> dict[str, list[str]]:
        """Prometheus job -> targets, as the compose config names them."""
        base, p = self.metrics_base, self.prefill
        stage_ports = range(base + 1 + p + self.decode, self.port)
        return {
            "glmserve-router": [f"127.0.0.1:{self.port}"],
            "glmserve-kvstore": [f"127.0.0.1:{base}"],
            "glmserve-prefill": [f"127.0.0.1:{port}" for port in (*range(base + 1, base + 1 + p), *stage_ports)],
            "glmserve-decode": [f"127.0.0.1:{base + 1 + p + j}" for j in range(self.decode)],
        }

    def expect(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        """Read stdout lines until one matches ``pattern`` (pids and addresses noted on the way)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"the launcher exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, f"no line matching {pattern!r} in {timeout_s:.0f} s"
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if m := re.search(r"glmserve: (\S+)\s+(\S+)\s+\(.*pid (\d+)\)", line):
                self.addresses[m.group(1)], self.pids[m.group(1)] = m.group(2), int(m.group(3))
            if m := re.search(r"glmserve: (\S+) restarted \(pid (\d+)", line):
                self.pids[m.group(1)] = int(m.group(2))
            if m := re.search(pattern, line):
                return m

    def wait_serving(self, timeout_s: float = 400) -> None:
        self.expect(r"serving \S+ at (http://\S+)/v1", timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the router's /ready answers 200 (every role has a healthy worker)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            assert time.monotonic() < deadline, f"the router was not ready within {timeout_s:.0f} s"
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def ready(self) -> dict:
        """The router's /ready body (per-role worker health)."""
        return httpx.get(f"{self.url}/ready", timeout=5).json()

    def kill(self, name: str) -> float:
        """SIGKILL child ``name``; the monotonic time it was sent."""
        os.kill(self.pids[name], signal.SIGKILL)
        return time.monotonic()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self._log.close()
