"""A kvstore process with a host tier, and prefill / decode workers attached to it, on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from worker_fixtures import REPO, free_port

from glmserve.services.kvstore.client import KVStoreClient, KVStoreError
from glmserve.services.metrics_exposition import SERVICE_LABELS


class HostKVStore:
    """``python -m glmserve.services.kvstore.main --host-tier-bytes N --transfer KIND``."""

    def __init__(self, log: Path, transfer: str, host_tier_bytes: int, *extra: str,
                 start_timeout_s: float = 30.0) -> None:
        self.port, self.metrics_port, self.log = free_port(), free_port(), log
        self._start_timeout_s = start_timeout_s
        self._cmd = [sys.executable, "-m", "glmserve.services.kvstore.main", "--host", "127.0.0.1",
                     "--port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--host-tier-bytes", str(host_tier_bytes), "--transfer", transfer, *extra]
        self.address = f"127.0.0.1:{self.port}"
        self._start()

    def restart(self) -> None:
        """kill -9, then the same kvstore again on the same ports: an empty host tier and index."""
        self.client.close()
        self.proc.kill()
        self.proc.wait()
        self._start()

    def _start(self) -> None:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "NIXL_LOG_LEVEL": "WARN", "OMP_NUM_THREADS": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self._cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.client = KVStoreClient(self.address, timeout_s=2.0)
        log = self.log
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            try:
                self.client.health()
                break
            except KVStoreError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kvstore did not start:\n{log.read_text()}") from None
                time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics, by name."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if not set(s.labels) - set(SERVICE_LABELS)}

    def indexed_blocks(self, tier: str) -> float:
        """glmserve_kvstore_indexed_blocks{tier}: (worker, block) entries in the index."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "glmserve_kvstore_indexed_blocks" and s.labels.get("tier") == tier)

    def wait_metric(self, name: str, predicate, timeout_s: float = 15.0) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metrics().get(name, 0.0)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def hit_tokens(metrics: dict, tier: str) -> float:
    return metrics.get(("glmserve_worker_prefix_cache_hit_tokens_total", (("tier", tier),)), 0.0)
