"""One supervised service process: how to start it (`ChildSpec`) and one run of it (`ChildProcess`).

A spec is fixed for the launcher's life, ports included, so a restarted child comes back on the
address its peers already know. Any kind of service fits (kvstore, prefill, decode, router, a
LayerSplit stage): the supervisor only needs a command line, an address, a readiness check and a
stop rank.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildSpec:
    """How to start one service, the same way every time."""

    name: str  # "decode-0": prefixes its output and every message about it
    role: str  # "kvstore", "prefill", "decode", "router", ...: what it is, for messages and counts
    argv: tuple[str, ...]
    address: str  # host:port (or URL) it serves on; fixed, so a restart comes back there
    metrics_port: int | None = None
    stop_rank: int = 1  # stopped in increasing rank, each rank waited for before the next
    ready: Callable[[], bool] | None = None  # None: ready once it printed its READY line

    def __post_init__(self) -> None:
        if not self.name or not self.argv:
            raise ValueError("name, argv: must not be empty")


def exit_description(status: int) -> str:
    """'was killed by SIGKILL' / 'exited with status 1'."""
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when the launcher dies, even by SIGKILL
    (Linux ``PR_SET_PDEATHSIG``); None elsewhere. ``prctl`` is looked up here, in the parent: the
    child between fork and exec should do as little as possible."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class ChildProcess:
    """One run of a spec: the process, its output pump (each line prefixed with the spec's name)
    and whether it announced ``READY``. Children get their own session: the terminal's Ctrl-C
    reaches only the launcher, which stops them in order."""

    def __init__(self, spec: ChildSpec, env: dict[str, str], out_lock: threading.Lock,
                 preexec: Callable[[], None] | None = None):
        self.spec = spec
        self.announced_address: str | None = None  # from its READY line
        self._announced = threading.Event()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            list(spec.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env, start_new_session=True, preexec_fn=preexec,
        )
        self._pump = threading.Thread(target=self._forward, args=(out_lock,), name=f"out-{spec.name}",
                                      daemon=True)
        self._pump.start()

    def _forward(self, lock: threading.Lock) -> None:
        for line in self.proc.stdout:
            if self.announced_address is None and line.startswith("READY "):
                self.announced_address = line.split(maxsplit=1)[1].strip()
                self._announced.set()
            with lock:
                sys.stderr.write(f"[{self.spec.name}] {line}")
                sys.stderr.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_ready(self) -> bool:
        return self._announced.is_set() if self.spec.ready is None else self.spec.ready()

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, deadline: float) -> bool:
        """Wait until it exited or ``deadline``; True if it exited."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        self._pump.join(timeout=1)
        return True
