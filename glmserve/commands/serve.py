"""`glmserve serve`: the whole platform on this machine, one supervised process per service.

The layout (`plan`): the kvstore, N prefill and M decode workers and the router, each with ports
chosen once at start (free ports on ``--host``; the router's ``--port``), so a restarted child
comes back on the address the others know. Everything starts at once; the launcher waits until
every worker printed ``READY``, the kvstore answers Health and the router's ``/ready`` is 200, then
prints the URL. Every child's output is forwarded to stderr, prefixed with its name.

While serving, a child that dies is restarted alone (`Supervisor`: backoff, and a limit after
which the launcher gives up, stops everything and exits 1); the others keep serving, and only the
requests that were on the dead process fail. Ctrl-C / SIGTERM / SIGHUP stop everything in stop
ranks: the router (it drains: stops admitting, lets what runs finish), then the workers (they
drain too), then the kvstore; SIGKILL after ``drain_timeout_s`` plus a margin. No child depends on
that order (on Kubernetes every pod gets its SIGTERM at once): it only spares clients errors.
Children get SIGTERM if the launcher itself dies (Linux).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glmserve.commands.child import ChildSpec
from glmserve.commands.free_ports import free_ports
from glmserve.commands.supervisor import GaveUp, RestartPolicy, Supervisor
from glmserve.core.dtype_names import DTYPE_CHOICES
from glmserve.engine.engine_config import MTP_HELP, mtp_option

_WORKER_MODULES = {"prefill": "glmserve.services.prefill.main", "decode": "glmserve.services.decode.main"}
STOP_RANKS = {"router": 0, "prefill": 1, "decode": 1, "kvstore": 2}  # stopped in this order


@dataclass(frozen=True)
class ServeConfig:
    model: Path
    prefill_workers: int = 1
    decode_workers: int = 1
    host: str = "127.0.0.1"  # every service listens here only
    port: int = 8000  # the router's; 0: any free port
    transfer: str = "auto"  # auto | nixl | tcp
    redis_url: str | None = None  # the kvstore's index in Redis instead of in memory
    host_tier_bytes: int = 256 << 20  # the kvstore's host KV tier; 0: none (workers then run without it)
    api_keys: tuple[str, ...] = ()
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0  # how long a stopping child may let running requests finish
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    metrics_port_base: int = 0  # kvstore here, prefill-i at +1+i, decode-j, then LayerSplit stages; 0: free
    prefill_stages: int = 1  # LayerSplit: stage processes per prefill worker
    prefill_layer_split: str | None = None  # explicit stage ranges (else the planner's)
    routing: str = "cache_aware"  # the router's --routing (checked by the router)
    local_prefill: str = "auto"  # the router's --local-prefill (checked by the router)
    reasoning_parser: str = "glm45"  # the router's --reasoning-parser (checked by the router)
    migration_limit: int = 3  # the router's --migration-limit (0: streams never resume elsewhere)
    dtype: str = "auto"  # every worker's --dtype (checked by the workers)
    mtp: str = "auto"  # every worker's --mtp: speculative decoding, and so the KV layout they share
    decode_step_tokens: int | None = None  # the decode workers' --max-step-tokens (None: their default)
    shared_prompt_tokens: int | None = None  # every worker's --shared-prompt-tokens (None: the engine's default)

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
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s: must be > 0, got {self.ready_timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        if self.prefill_stages < 1:
            raise ValueError(f"prefill_stages: must be >= 1, got {self.prefill_stages}")
        mtp_option(self.mtp)  # refused here, not by every worker as it starts
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit: must be >= 0, got {self.migration_limit}")
        if self.decode_step_tokens is not None and self.decode_step_tokens < 1:
            raise ValueError(f"decode_step_tokens: must be >= 1, got {self.decode_step_tokens}")
        if self.shared_prompt_tokens is not None and self.shared_prompt_tokens < 1:
            raise ValueError(f"shared_prompt_tokens: must be >= 1, got {self.shared_prompt_tokens}")
        self.layer_plan()  # ValueError naming prefill_stages or prefill_layer_split
        last = self.metrics_port_base + self.num_metrics_ports - 1
        if self.metrics_port_base and not (0 < self.metrics_port_base and last <= 65535):
            raise ValueError(f"metrics_port_base: {self.metrics_port_base} + one port per child must fit in "
                             "[1, 65535]")

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

    @property
    def grace_s(self) -> float:
        """How long a child may take to stop after SIGTERM before it is killed: its drain, plus
        time to end what the drain left and to close."""
        return self.drain_timeout_s + 10.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeConfig:
        restart = RestartPolicy(max_restarts=args.max_restarts, max_backoff_s=args.max_restart_backoff)
        return cls(args.model.resolve(), args.prefill_workers, args.decode_workers, port=args.port,
                   transfer=args.transfer, redis_url=args.redis_url, api_keys=tuple(args.api_key),
                   ready_timeout_s=args.ready_timeout, host_tier_bytes=args.host_tier_bytes,
                   drain_timeout_s=args.drain_timeout, restart=restart,
                   metrics_port_base=getattr(args, "metrics_port_base", 0),
                   prefill_stages=getattr(args, "prefill_stages", 1),
                   prefill_layer_split=getattr(args, "prefill_layer_split", None),
                   routing=getattr(args, "routing", cls.routing),
                   local_prefill=getattr(args, "local_prefill", cls.local_prefill),
                   reasoning_parser=getattr(args, "reasoning_parser", cls.reasoning_parser),
                   migration_limit=getattr(args, "migration_limit", cls.migration_limit),
                   dtype=getattr(args, "dtype", cls.dtype), mtp=getattr(args, "mtp", cls.mtp),
                   decode_step_tokens=getattr(args, "decode_step_tokens", cls.decode_step_tokens),
                   shared_prompt_tokens=getattr(args, "shared_prompt_tokens", cls.shared_prompt_tokens))

    @property
    def num_metrics_ports(self) -> int:
        """kvstore, every worker, then stages 1.. of every LayerSplit prefill worker."""
        layers = self.layer_plan()
        stages = len(layers.stages) if layers is not None else 1
        return 1 + self.prefill_workers + self.decode_workers + self.prefill_workers * (stages - 1)

    def metrics_port(self, index: int) -> int | None:
        """The fixed metrics port of child ``index`` (kvstore 0, prefill 1..P, decode after them, then
        stage k >= 1 of prefill-i at 1+P+D + i*(stages-1) + k-1); None: a free one."""
        return self.metrics_port_base + index if self.metrics_port_base else None


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `glmserve serve` (besides ``--model``); `ServeConfig.from_args` reads them."""
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--prefill-stages", type=int, default=1,
                   help="LayerSplit: stage processes per prefill worker, each holding a contiguous layer range")
    p.add_argument("--prefill-layer-split", default=None,
                   help="LayerSplit: explicit stage ranges, e.g. 0-3,4-7 (default: the placement planner's)")
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--port", type=int, default=8000, help="the router's HTTP port on 127.0.0.1 (0: any free)")
    p.add_argument("--transfer", choices=["auto", "nixl", "tcp"], default="auto", help="KV transfer backend")
    p.add_argument("--redis-url", default=None, help="keep the kvstore's block index in Redis")
    p.add_argument("--host-tier-bytes", type=int, default=256 << 20,
                   help="size of the kvstore's host (CPU) KV tier; 0: none")
    p.add_argument("--api-key", action="append", default=[], help="require this key (repeatable)")
    p.add_argument("--routing", choices=["cache_aware", "least_loaded", "round_robin"], default="cache_aware",
                   help="how the router picks a prefill worker")
    p.add_argument("--local-prefill", choices=["auto", "off", "always"], default=ServeConfig.local_prefill,
                   help="auto: a decode worker prefills a prompt itself while prompts queue at the prefill "
                        "workers; off: never; always: every prompt")
    p.add_argument("--reasoning-parser", choices=["glm45", "none"], default=ServeConfig.reasoning_parser,
                   help="glm45: chat answers carry <think> blocks as reasoning_content; none: in the content")
    p.add_argument("--migration-limit", type=int, default=ServeConfig.migration_limit,
                   help="how often a stream whose decode worker died may resume on another one (0: never)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=ServeConfig.dtype,
                   help="every worker's weights and KV: auto (bfloat16 where the CPU has bf16 instructions, "
                        "else float32)")
    p.add_argument("--mtp", default=ServeConfig.mtp, help=f"{MTP_HELP}, on every worker")
    p.add_argument("--decode-step-tokens", type=int, default=None,
                   help="prompt tokens a decode worker computes per step when it prefills a prompt itself "
                        "(default: the decode workers' own)")
    p.add_argument("--shared-prompt-tokens", type=int, default=None,
                   help="prompt tokens several prompts may share a worker's engine step with (default: the "
                        "engine's, 512)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for every service")
    p.add_argument("--drain-timeout", type=float, default=ServeConfig.drain_timeout_s,
                   help="on stop, seconds each service lets running requests finish")
    p.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                   help="restarts in a row of one service before the launcher gives up")
    p.add_argument("--max-restart-backoff", type=float, default=RestartPolicy.max_backoff_s,
                   help="longest wait before restarting a service (the wait doubles per restart)")
    p.add_argument("--metrics-port", type=int, default=0, dest="metrics_port_base",
                   help="fixed metrics ports from BASE: kvstore BASE, prefill-i BASE+1+i, then decode-j "
                   "after the prefill workers, then LayerSplit stages 1.. of each prefill worker in order "
                   "(0: free ports; the router's are on its HTTP port)")


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def kvstore_ready(address: str) -> Callable[[], bool]:
    def check() -> bool:
        from glmserve.services.kvstore.client import KVStoreClient, KVStoreError

        try:
            with KVStoreClient(address, timeout_s=0.5) as client:
                client.health()
            return True
        except KVStoreError:
            return False

    return check


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    return check


def plan(cfg: ServeConfig) -> list[ChildSpec]:
    """Every child of the platform, ports fixed (metrics ports from ``metrics_port_base`` when set)."""
    py = sys.executable
    workers = [(kind, i) for kind, count in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers))
               for i in range(count)]
    layers = cfg.layer_plan()
    extra_stages = cfg.prefill_workers * (len(layers.stages) - 1) if layers is not None else 0
    free = iter(free_ports(cfg.host, 2 * (1 + len(workers)) + 1 + 2 * extra_stages))
    metrics = [cfg.metrics_port(i) or next(free) for i in range(1 + len(workers) + extra_stages)]
    stage_metrics = iter(metrics[1 + len(workers):])  # stages 1.. of each prefill worker, in order
    kv_port, router_port = next(free), cfg.port or next(free)
    kv = f"{cfg.host}:{kv_port}"
    labels = ("--served-model-name", cfg.model.name)  # the model_name label of their metrics
    redis = ["--redis-url", cfg.redis_url] if cfg.redis_url else []
    host_tier = ["--host-tier-bytes", str(cfg.host_tier_bytes), "--transfer", cfg.transfer] if cfg.host_tier_bytes else []
    specs = [ChildSpec("kvstore", "kvstore", (
        py, "-m", "glmserve.services.kvstore.main", "--host", cfg.host, "--port", str(kv_port),
        "--metrics-port", str(metrics[0]), *labels, *redis, *host_tier), kv, metrics[0], STOP_RANKS["kvstore"],
        ready=kvstore_ready(kv))]
    addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
    for (kind, i), metrics_port in zip(workers, metrics[1:1 + len(workers)], strict=True):
        address = f"{cfg.host}:{next(free)}"
        addresses[kind].append(address)
        argv = (py, "-m", _WORKER_MODULES[kind], "--model", str(cfg.model), "--host", cfg.host,
                "--worker-id", f"{kind}-{i}", "--transfer", cfg.transfer, "--kvstore", kv,
                "--drain-timeout-s", str(cfg.drain_timeout_s), "--dtype", cfg.dtype, "--mtp", cfg.mtp, *labels)
        if cfg.shared_prompt_tokens is not None:
            argv += ("--shared-prompt-tokens", str(cfg.shared_prompt_tokens))
        if kind == "prefill" and layers is not None:
            stages = [address, *(f"{cfg.host}:{next(free)}" for _ in layers.stages[1:])]
            ports = [metrics_port, *(next(stage_metrics) for _ in layers.stages[1:])]
            specs += stage_specs(f"{kind}-{i}", argv, stages, layers.spec(), ports)
            continue
        if kind == "decode" and cfg.decode_step_tokens is not None:
            argv += ("--max-step-tokens", str(cfg.decode_step_tokens))
        specs.append(ChildSpec(f"{kind}-{i}", kind, (
            *argv, "--port", address.rsplit(":", 1)[1], "--metrics-port", str(metrics_port)),
            address, metrics_port, STOP_RANKS[kind]))
    url = f"http://{cfg.host}:{router_port}"
    specs.append(ChildSpec("router", "router", (
        py, "-m", "glmserve.services.router.main", "--model", str(cfg.model), "--host", cfg.host,
        "--port", str(router_port), "--kvstore", kv, "--prefill", ",".join(addresses["prefill"]),
        "--decode", ",".join(addresses["decode"]), "--routing", cfg.routing, "--reasoning-parser", cfg.reasoning_parser,
        "--local-prefill", cfg.local_prefill,
        "--drain-timeout-s", str(cfg.drain_timeout_s), "--migration-limit", str(cfg.migration_limit),
        *[a for key in cfg.api_keys for a in ("--api-key", key)]),
        url, None, STOP_RANKS["router"], ready=http_ok(f"{url}/ready")))
    return specs


def stage_specs(name: str, argv: tuple[str, ...], addresses: list[str], split: str,
                metrics_ports: list[int]) -> list[ChildSpec]:
    """One LayerSplit prefill worker: a process per stage on fixed ports (each is told them all, so
    a restarted stage comes back where the others look for it); stage 0, the head, serves Prefill
    under the worker's name. Every stage has its metrics (its engine, its process)."""
    specs = []
    for k, (address, metrics_port) in enumerate(zip(addresses, metrics_ports, strict=True)):
        stage = ("--port", address.rsplit(":", 1)[1], "--stage-index", str(k), "--stage-addresses",
                 ",".join(addresses), "--layer-split", split, "--metrics-port", str(metrics_port))
        specs.append(ChildSpec(name if k == 0 else f"{name}.s{k}", "prefill", (*argv, *stage), address,
                               metrics_port, STOP_RANKS["prefill"]))
    return specs


class Launcher:
    """The platform's children under one `Supervisor` (see the module docstring)."""

    def __init__(self, config: ServeConfig, stop: threading.Event):
        self.config, self.stop = config, stop
        self._out_lock = threading.Lock()  # one line at a time: ours and the children's
        self.supervisor = Supervisor(config.restart, self._child_env(), self.say, self._out_lock)

    def _child_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # One process per worker: share the cores instead of every torch process taking all of them.
        workers = self.config.prefill_workers + self.config.decode_workers
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
        return env

    def say(self, message: str, err: bool = False) -> None:
        with self._out_lock:
            print(f"glmserve: {message}", file=sys.stderr if err else sys.stdout, flush=True)

    def bring_up(self, specs: list[ChildSpec]) -> None:
        """Start every child at once and wait until each is ready."""
        for spec in specs:
            self.supervisor.start(spec)
        deadline = time.monotonic() + self.config.ready_timeout_s
        self.supervisor.wait_ready([s.name for s in specs], deadline, self.stop, self.config.ready_timeout_s)
        for spec in specs:
            metrics = f"metrics {self.config.host}:{spec.metrics_port}" if spec.metrics_port else "metrics on /metrics"
            proc = self.supervisor.process(spec.name)
            self.say(f"{spec.name:<10} {spec.address}  ({metrics}, pid {proc.pid if proc else '-'})")

    def serve_until_stopped(self) -> None:
        while not self.stop.wait(0.2):
            self.supervisor.watch()

    def stop_all(self) -> None:
        self.supervisor.stop_all(self.config.grace_s)


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
        specs = plan(config)
        layers = config.layer_plan()
        if layers is not None:
            launcher.say(layers.describe())
        launcher.bring_up(specs)
        launcher.say(f"serving {config.model.name} at {specs[-1].address}/v1 (Ctrl-C stops every process)")
        launcher.serve_until_stopped()
        launcher.say("stopping")
    except (GaveUp, TimeoutError, InterruptedError) as e:
        launcher.say(f"{e}; stopping the other processes", err=True)
        status = 1
    finally:
        launcher.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    launcher.say("stopped")
    return status
