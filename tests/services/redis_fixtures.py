"""A real, throwaway redis-server on 127.0.0.1 for tests (no persistence, its own tmp dir).

Tests that need it use ``requires_redis_server``: they skip with a clear reason where the Debian
package ``redis-server`` is not installed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.shared import free_port  # noqa: F401 - the redis tests import it from here

REDIS_SERVER = shutil.which("redis-server")
requires_redis_server = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server not installed (apt-get install redis-server)"
)



class RedisServer:
    """``start()`` / ``stop()`` a redis-server; the port stays the same across restarts."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir, self.port = workdir, port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 5.0) -> RedisServer:
        assert REDIS_SERVER is not None and self._proc is None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--logfile",
                str(self.workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = self.workdir / "redis.log"
                raise RuntimeError(f"redis-server on port {self.port} did not start; see {log}")
            time.sleep(0.02)
        return self

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
