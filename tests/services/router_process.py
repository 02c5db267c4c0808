"""The router as a real process on 127.0.0.1 for tests: ``RouterProcess.launch(...)`` starts
``python -m glmserve.services.router.main`` on a free port and waits for its ``READY`` line and
``/ready``; ``stop()`` sends SIGTERM, ``kill()`` is kill -9. ``metrics()`` parses its ``/metrics``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from worker_fixtures import MODEL_DIR, MetricSamples, metric_samples, read_ready_address, spawn_service


class RouterProcess:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc, self.log, self.url = proc, log, ""

    @classmethod
    def launch(cls, log: Path, prefill: list[str], decode: list[str], kvstore: str | None,
               *extra: str, timeout_s: float = 60.0) -> RouterProcess:
        cmd = [sys.executable, "-m", "glmserve.services.router.main", "--model", str(MODEL_DIR),
               "--host", "127.0.0.1", "--port", "0", "--prefill", ",".join(prefill),
               "--decode", ",".join(decode), "--poll-interval", "0.2", *extra]
        if kvstore is not None:
            cmd += ["--kvstore", kvstore]
        router = cls(spawn_service(cmd, log), log)
        deadline = time.monotonic() + timeout_s
        router.url = read_ready_address(router.proc, log, "router", timeout_s)
        while router.ready().status_code != 200:
            if time.monotonic() > deadline:
                router.kill()
                raise RuntimeError(f"router never ready:\n{log.read_text()}")
            time.sleep(0.1)
        return router

    def ready(self) -> httpx.Response:
        return httpx.get(f"{self.url}/ready", timeout=5)

    def metrics(self) -> MetricSamples:
        return metric_samples(httpx.get(f"{self.url}/metrics", timeout=5).text)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
