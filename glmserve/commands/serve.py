"""`glmserve serve`: the whole platform on this machine, one process per service on 127.0.0.1.

Starts the kvstore, N prefill and M decode workers (free ports), waits until each is ready (workers
print ``READY host:port``; the kvstore answers Health), then the router pointed at them, waits until
its ``/ready`` is 200, and prints the URL. Every child's output is forwarded to stderr, prefixed with
its name. Ctrl-C / SIGTERM / SIGHUP stop every started process (router first, so clients see their
streams end, then workers and kvstore; SIGKILL after a grace period); a child that dies on its own
is reported and the rest are stopped (exit status 1), as is a start that does not finish in time.
Children get their own session (the terminal's Ctrl-C reaches only this launcher, which stops them
in order) and, on Linux, SIGTERM if the launcher itself dies.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_WORKER_MODULES = {"prefill": "glmserve.services.prefill.main", "decode": "glmserve.services.decode.main"}


@dataclass(frozen=True)
class ServeConfig:
    model: Path
    prefill_workers: int = 1
    decode_workers: int = 1
    host: str = "127.0.0.1"
    port: int = 8000  # the router's; 0: any free port
    transfer: str = "auto"  # auto | nixl | tcp
    redis_url: str | None = None  # the kvstore's index in Redis instead of in memory
    host_tier_bytes: int = 256 << 20  # the kvstore's host KV tier; 0: none (workers then run without it)
    api_keys: tuple[str, ...] = ()
    ready_timeout_s: float = 300.0
    grace_s: float = 10.0  # how long a child may take to stop after SIGTERM
    metrics_port_base: int = 0  # kvstore here, prefill-i at +1+i, decode-j after them; 0: free ports
    prefill_stages: int = 1  # LayerSplit: stage processes per prefill worker
    prefill_layer_split: str | None = None  # explicit stage ranges (else the planner's)
    routing: str = "cache_aware"  # the router's --routing (checked by the router)

    def __post_init__(self) -> None:
        if not (self.model / "config.json").is_file():
            raise ValueError(f"model: no config.json in {self.model}")
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("prefill_workers / decode_workers: at least 1 of each")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.transfer not in ("auto", "nixl", "tcp"):
            raise ValueError(f"transfer: must be auto, nixl or tcp, got {self.transfer!r}")
        if self.host_tier_bytes < 0:
            raise ValueError(f"host_tier_bytes: must be >= 0, got {self.host_tier_bytes}")
        last = self.metrics_port_base + self.prefill_workers + self.decode_workers
        if self.metrics_port_base and not (0 < self.metrics_port_base and last <= 65535):
            raise ValueError(f"metrics_port_base: {self.metrics_port_base} + one port per child must fit in "
                             "[1, 65535]")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s: must be > 0, got {self.ready_timeout_s}")
        if self.prefill_stages < 1:
            raise ValueError(f"prefill_stages: must be >= 1, got {self.prefill_stages}")
        self.layer_plan()  # ValueError naming prefill_stages or prefill_layer_split

    def layer_plan(self):
        """The LayerSplit plan every prefill worker's stages follow (None: one process each)."""
        from glmserve.model.config import GlmConfig  # no torch: the launcher stays light
        from glmserve.model.layer_split import parse_layer_split, plan_layer_split

        if self.prefill_stages == 1 and self.prefill_layer_split is None:
            return None
        config = GlmConfig.from_pretrained(self.model)
        if self.prefill_layer_split is not None:
            stages = None if self.prefill_stages == 1 else self.prefill_stages
            return parse_layer_split(self.prefill_layer_split, config, stages)
        return plan_layer_split(config, self.prefill_stages)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        return cls(args.model.resolve(), args.prefill_workers, args.decode_workers, port=args.port,
                   transfer=args.transfer, redis_url=args.redis_url, api_keys=tuple(args.api_key),
                   ready_timeout_s=args.ready_timeout, host_tier_bytes=args.host_tier_bytes,
                   metrics_port_base=getattr(args, "metrics_port_base", 0),
                   prefill_stages=getattr(args, "prefill_stages", 1),
                   prefill_layer_split=getattr(args, "prefill_layer_split", None),
                   routing=getattr(args, "routing", cls.routing))

    def metrics_port(self, index: int) -> int | None:
        """The fixed metrics port of child ``index`` (kvstore 0, prefill 1..P, decode after); None: free."""
        return self.metrics_port_base + index if self.metrics_port_base else None


class LaunchError(Exception):
    """Starting the platform failed; the message says which process and why."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


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


class Child:
    """One started service: its process, its output pump and the address it announced."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], out_lock: threading.Lock,
                 metrics_port: int | None = None, preexec: Callable[[], None] | None = None):
        self.name, self.metrics_port = name, metrics_port
        self.address: str | None = None  # from its READY line
        self._announced = threading.Event()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, start_new_session=True, preexec_fn=preexec,
        )
        self._pump = threading.Thread(target=self._forward, args=(out_lock,), name=f"out-{name}", daemon=True)
        self._pump.start()

    def _forward(self, lock: threading.Lock) -> None:
        for line in self.proc.stdout:
            if self.address is None and line.startswith("READY "):
                self.address = line.split(maxsplit=1)[1].strip()
                self._announced.set()
            with lock:
                sys.stderr.write(f"[{self.name}] {line}")
                sys.stderr.flush()

    @property
    def announced(self) -> bool:
        return self._announced.is_set()

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, deadline: float) -> bool:
        """Wait until it exited or ``deadline``; True if it exited."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        self._pump.join(timeout=1)
        return True


def _kvstore_ready(address: str) -> Callable[[], bool]:
    def check() -> bool:
        from glmserve.services.kvstore.client import KVStoreClient, KVStoreError

        try:
            with KVStoreClient(address, timeout_s=0.5) as client:
                client.health()
            return True
        except KVStoreError:
            return False

    return check


def _http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    return check


class Launcher:
    """Starts children, waits for them, stops them all (see the module docstring)."""

    def __init__(self, config: ServeConfig, stop: threading.Event):
        self.config, self.stop = config, stop
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self._env = self._child_env()
        self._preexec = die_with_parent_hook()

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # One process per worker: share the cores instead of every torch process taking all of them.
        workers = self.config.prefill_workers + self.config.decode_workers
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        return env

    def say(self, message: str, err: bool = False) -> None:
        with self._lock:
            print(f"glmserve: {message}", file=sys.stderr if err else sys.stdout, flush=True)

    def start(self, name: str, module: str, *args: str, metrics: bool = True, metrics_port: int | None = None) -> Child:
        """Start ``python -m module args``; with ``metrics``, on ``--metrics-port metrics_port`` (a free
        one when None) and the served model name as its metrics' ``model_name``."""
        port = (metrics_port or free_port(self.config.host)) if metrics else None
        extra = ["--metrics-port", str(port), "--served-model-name", self.config.model.name] if port is not None else []
        argv = [sys.executable, "-m", module, *args, *extra]
        child = Child(name, argv, self._env, self._lock, port, self._preexec)
        self.children.append(child)
        return child

    def wait_ready(self, checks: dict[Child, Callable[[], bool]], deadline: float) -> None:
        """Until every check passes; `LaunchError` on a death, a stop request or the deadline."""
        pending = dict(checks)
        while pending:
            self.check_alive()
            if self.stop.is_set():
                raise LaunchError("stopped before every process was ready")
            pending = {c: ok for c, ok in pending.items() if not ok()}
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise LaunchError(f"timed out after {self.config.ready_timeout_s:.0f} s waiting for {names} "
                                  "to be ready (see their output above)")
            if pending:
                self.stop.wait(0.1)

    def check_alive(self) -> None:
        for child in self.children:
            status = child.exit_status()
            if status is not None:
                how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
                raise LaunchError(f"{child.name} {how} unexpectedly")

    def stop_all(self) -> None:
        """SIGTERM the router, then everything else; SIGKILL whatever outlives the grace period."""
        routers = [c for c in self.children if c.name == "router"]
        for group in (routers, [c for c in self.children if c not in routers]):
            for child in group:
                child.terminate()
            deadline = time.monotonic() + self.config.grace_s
            for child in group:
                if not child.wait(deadline):
                    self.say(f"{child.name} did not stop in {self.config.grace_s:.0f} s; killing it", err=True)
                    child.proc.kill()
                    child.wait(time.monotonic() + 5)


def _start_stages(launcher: Launcher, name: str, split: str, num_stages: int, common: list[str],
                  metrics_port: int | None) -> list[Child]:
    """One LayerSplit prefill worker: a process per stage on fixed ports (each is told them all);
    stage 0, the head, first (it serves Prefill and has the metrics)."""
    host = launcher.config.host
    addresses = [f"{host}:{free_port(host)}" for _ in range(num_stages)]
    children = []
    for k, address in enumerate(addresses):
        args = [*common, "--port", address.rsplit(":", 1)[1], "--stage-index", str(k),
                "--stage-addresses", ",".join(addresses), "--layer-split", split]
        children.append(launcher.start(name if k == 0 else f"{name}.s{k}", _WORKER_MODULES["prefill"], *args,
                                       metrics=k == 0, metrics_port=metrics_port))
    return children


def _bring_up(launcher: Launcher) -> str:
    """Start every service; returns the router's URL."""
    cfg = launcher.config
    deadline = time.monotonic() + cfg.ready_timeout_s
    kv_port = free_port(cfg.host)
    redis = ["--redis-url", cfg.redis_url] if cfg.redis_url else []
    host_tier = ["--host-tier-bytes", str(cfg.host_tier_bytes), "--transfer", cfg.transfer]
    kvstore = launcher.start("kvstore", "glmserve.services.kvstore.main",
                             "--host", cfg.host, "--port", str(kv_port), *redis,
                             *(host_tier if cfg.host_tier_bytes else []), metrics_port=cfg.metrics_port(0))
    kvstore.address = f"{cfg.host}:{kv_port}"
    workers: dict[str, list[Child]] = {"prefill": [], "decode": []}
    first = {"prefill": 1, "decode": 1 + cfg.prefill_workers}
    plan = cfg.layer_plan()
    if plan is not None:
        launcher.say(plan.describe())
    stages: list[Child] = []  # LayerSplit stages 1.. (each replica's head is its prefill worker)
    for kind, count in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)):
        for i in range(count):
            common = ["--model", str(cfg.model), "--host", cfg.host, "--worker-id", f"{kind}-{i}",
                      "--transfer", cfg.transfer, "--kvstore", kvstore.address]
            if kind == "prefill" and plan is not None:
                replica = _start_stages(launcher, f"prefill-{i}", plan.spec(), len(plan.stages), common,
                                        cfg.metrics_port(first[kind] + i))
                workers[kind].append(replica[0])
                stages += replica[1:]
                continue
            workers[kind].append(launcher.start(f"{kind}-{i}", _WORKER_MODULES[kind], *common, "--port", "0",
                                                metrics_port=cfg.metrics_port(first[kind] + i)))
    checks: dict[Child, Callable[[], bool]] = {kvstore: _kvstore_ready(kvstore.address)}
    checks.update({c: (lambda c=c: c.announced) for group in [*workers.values(), stages] for c in group})
    launcher.wait_ready(checks, deadline)
    router = launcher.start(
        "router", "glmserve.services.router.main", "--model", str(cfg.model), "--host", cfg.host,
        "--port", str(cfg.port), "--kvstore", kvstore.address,
        "--prefill", ",".join(c.address for c in workers["prefill"]),
        "--decode", ",".join(c.address for c in workers["decode"]), "--routing", cfg.routing,
        *[arg for key in cfg.api_keys for arg in ("--api-key", key)], metrics=False)  # on its HTTP port
    launcher.wait_ready({router: lambda: router.announced}, deadline)
    launcher.wait_ready({router: _http_ok(f"{router.address}/ready")}, deadline)
    for child in launcher.children:
        metrics = f"metrics {cfg.host}:{child.metrics_port}" if child.metrics_port else "metrics on /metrics"
        launcher.say(f"{child.name:<10} {child.address}  ({metrics}, pid {child.proc.pid})")
    return router.address


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = ServeConfig.from_args(args)
    except ValueError as e:
        print(f"glmserve serve: {e}", file=sys.stderr)
        return 2
    missing = [m for m in _WORKER_MODULES.values() if not module_exists(m)]
    if missing:
        print(f"glmserve serve: worker services not installed: {', '.join(missing)}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    launcher = Launcher(config, stop)
    status = 0
    try:
        url = _bring_up(launcher)
        launcher.say(f"serving {config.model.name} at {url}/v1 (Ctrl-C stops every process)")
        while not stop.wait(0.2):
            launcher.check_alive()
        launcher.say("stopping")
    except LaunchError as e:
        launcher.say(f"{e}; stopping the other processes", err=True)
        status = 1
    finally:
        launcher.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    launcher.say("stopped")
    return status
