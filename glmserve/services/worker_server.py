"""What the prefill and decode worker processes share: common flags, the transfer backend choice,
and the process life (load, serve gRPC, print READY, stop cleanly on SIGTERM / SIGINT).

Life of a worker process (``run_worker``):
1. build the worker and start it (the engine loads on its thread; a signal meanwhile stops it);
2. serve gRPC (grpc.aio) on ``--host:--port`` (0: a free port), with ``grpc.health.v1`` for probes
   (`liveness`), and metrics on ``--metrics-port``;
3. print ``READY <host>:<port>`` on stdout (flushed; logs go to stderr), the launcher's cue;
4. on SIGTERM / SIGINT: ``worker.drain(drain_timeout_s)`` (Health turns not ready, no new work is
   admitted, running requests may finish; a second signal cuts the drain short), then
   ``worker.close()`` (ends what is left: streams end with an error event, a prefill worker drains
   its transfers while its Abort RPC still answers), then stop the server, then the metrics endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from prometheus_client import CollectorRegistry

from glmserve.core.dtype_names import DTYPE_CHOICES
from glmserve.engine.engine_config import MTP_HELP, mtp_option
from glmserve.kv.transfer.timeouts import AGREED
from glmserve.services.host_tier_link import HostTierSettings
from glmserve.services.kv_events import KVEventPublisher, PublisherCollector
from glmserve.services.kvstore.client import KVStoreClient
from glmserve.services.liveness import HealthReporter
from glmserve.services.metrics_exposition import MetricsServer, labelled
from glmserve.services.tracing import Tracing

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TRANSFER_TIMEOUT_S = AGREED.write_s  # a write is final within this + the drain timeout
GRACE_S = 2.0  # how long in-flight RPCs may finish on shutdown
DEFAULT_STAGING_BLOCKS = 8
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, how long running requests may finish


class Worker(Protocol):
    async def start(self) -> None: ...

    def live(self) -> bool: ...  # the process can serve (engine thread alive, not stuck)

    def ready(self) -> bool: ...  # requests may be sent here

    async def drain(self, timeout_s: float) -> int: ...

    async def close(self) -> None: ...


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (config, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--transfer", choices=("auto", "nixl", "tcp"), default="auto",
                   help="KV transfer: NIXL when it imports (auto), or TCP")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint (off if absent)")
    p.add_argument("--served-model-name", default=None,
                   help="the model_name label of this worker's metrics (default: the model directory's name)")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache size (engine default if absent)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="prompt tokens an engine step may compute (the chunked-prefill budget; engine default if absent)")
    p.add_argument("--shared-prompt-tokens", type=int, default=None,
                   help="prompt tokens several prompts may share an engine step with (engine default if absent)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights and KV cache: auto (bfloat16 where the CPU has bf16 instructions, else float32)")
    p.add_argument("--mtp", default="auto",
                   help=f"{MTP_HELP}; a platform's prefill and decode workers must agree (it sets the KV layout)")
    p.add_argument("--kvstore", default=None,
                   help="host:port of the kvstore: publish this worker's cached blocks to its index and "
                   "use its host KV tier (load-back, write-through, demotion)")
    p.add_argument("--revision", default=None,
                   help="model revision for the prefix-cache key (default: a digest of the checkpoint)")
    p.add_argument("--host-write-through", choices=("on", "off"), default="on", dest="host_tier_write_through",
                   help="write a finished request's full KV blocks to the host tier")
    p.add_argument("--check-integrity", action="store_true",
                   help="check the KV block pool after every engine step (for tests; costs a pool scan)")
    p.add_argument("--host-staging-blocks", type=int, default=DEFAULT_STAGING_BLOCKS, dest="host_tier_staging_blocks",
                   help="cache rows kept for demoting evicted blocks to the host tier (0: no demotion)")
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM, how long running requests may finish before they are ended")


@dataclass(frozen=True)
class WorkerConfig:
    """The flags every worker takes (`add_common_args`); prefill and decode add their own."""

    model: str
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 0
    transfer: str = "auto"
    metrics_port: int | None = None
    kv_cache_bytes: int | None = None
    max_step_tokens: int | None = None  # the engine's chunked-prefill budget (None: its default)
    shared_prompt_tokens: int | None = None  # EngineConfig.max_shared_prompt_tokens (None: its default)
    dtype: str = "auto"  # the model's and the KV cache's (`resolve_dtype`); prefill and decode must agree
    mtp: str = "auto"  # EngineConfig.mtp as spelled on the command line; prefill and decode must agree
    kvstore: str | None = None  # host:port: publish block events to its index, use its host tier
    revision: str | None = None  # explicit model revision for the prefix-cache key
    host_tier_write_through: str = "on"  # the CPU KV tier's; `host` is the address we bind
    host_tier_staging_blocks: int = DEFAULT_STAGING_BLOCKS
    check_integrity: bool = False
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    served_model_name: str | None = None  # the metrics' model_name (None: the model directory's name)

    def __post_init__(self) -> None:
        check_port("port", self.port)
        check_port("metrics_port", self.metrics_port)
        check_kvstore(self.kvstore)
        if not self.worker_id:
            raise ValueError("worker_id: must not be empty")
        if self.host_tier_write_through not in ("on", "off"):
            raise ValueError(f"host_tier_write_through: must be 'on' or 'off', got {self.host_tier_write_through!r}")
        if self.host_tier_staging_blocks < 0:
            raise ValueError(f"host_tier_staging_blocks: must be >= 0, got {self.host_tier_staging_blocks}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        mtp_option(self.mtp)  # ValueError naming the field
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be > 0, got {self.kv_cache_bytes}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens: must be >= 1, got {self.max_step_tokens}")
        if self.shared_prompt_tokens is not None and self.shared_prompt_tokens < 1:
            raise ValueError(f"shared_prompt_tokens: must be >= 1, got {self.shared_prompt_tokens}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def engine_config(self) -> dict[str, int | bool | str]:
        """Engine config fields (and the dtype) from the worker flags."""
        options: dict[str, int | bool | str] = {"dtype": self.dtype, "mtp": mtp_option(self.mtp)}
        if self.kv_cache_bytes is not None:
            options["kv_cache_bytes"] = self.kv_cache_bytes
        if self.max_step_tokens is not None:
            options["max_step_tokens"] = self.max_step_tokens
        if self.shared_prompt_tokens is not None:
            options["max_shared_prompt_tokens"] = self.shared_prompt_tokens
        if self.check_integrity:
            options["check_integrity"] = True
        if self.kvstore is not None:
            options["host_staging_blocks"] = self.host_tier_staging_blocks
        return options

    def host_tier_settings(self) -> HostTierSettings | None:
        """How the worker uses the kvstore's host tier (None without ``--kvstore``)."""
        if self.kvstore is None:
            return None
        return HostTierSettings(self.kvstore, self.worker_id, write_through=self.host_tier_write_through == "on")


def check_port(field: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= 65535:
        raise ValueError(f"{field}: must be in [0, 65535], got {value}")


def check_kvstore(value: str | None) -> None:
    """``--kvstore`` is None or ``host:port``."""
    if value is None:
        return
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kvstore: expected host:port, got {value!r}")


def build_engine(model: str, revision: str | None, config: dict[str, Any],
                 publisher: KVEventPublisher | None) -> Engine:
    """The worker's engine (on its engine thread), its pool's events going to ``publisher``."""
    from glmserve.engine.engine import Engine  # torch: imported here, not at module import

    engine = Engine.from_model_dir(model, revision=revision, **config)
    if publisher is not None:
        engine.add_block_listener(publisher)
    return engine


def start_block_events(kvstore: str | None, worker_id: str) -> KVEventPublisher | None:
    """The publisher of this worker's block events to ``kvstore`` (None: no kvstore), started.
    Attach it with ``engine.add_block_listener``; ``close()`` it on exit."""
    if kvstore is None:
        return None
    publisher = KVEventPublisher(worker_id, KVStoreClient(kvstore, timeout_s=0.5))
    publisher.start()
    return publisher


async def serve_worker(config: WorkerConfig, worker: Worker, add_servicer: Callable[[grpc.aio.Server], None],
                       registry: CollectorRegistry | None, publisher: KVEventPublisher | None, name: str,
                       role: str, service: str, tracing: Tracing | None = None) -> int:
    """`run_worker` with the worker's block-event publisher on its metrics, closed on exit; every
    sample is served with the ``model_name`` and ``role`` labels. ``service``: the full gRPC service
    name (readiness in ``grpc.health.v1``); the server traces the calls of requests with ``tracing``
    (off when None)."""
    if publisher is not None and registry is not None:
        registry.register(PublisherCollector(publisher))
    try:
        served = None if registry is None else labelled(registry, {"model_name": config.model_name, "role": role})
        return await run_worker(worker, add_servicer, host=config.host, port=config.port, registry=served,
                                metrics_port=config.metrics_port, name=name, service=service,
                                drain_timeout_s=config.drain_timeout_s,
                                interceptors=tracing.server_interceptors() if tracing is not None else ())
    finally:
        if publisher is not None:
            await asyncio.to_thread(publisher.close)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def run_worker(
    worker: Worker,
    add_servicer: Callable[[grpc.aio.Server], None],
    *,
    host: str,
    port: int,
    registry: CollectorRegistry | None,
    metrics_port: int | None,
    name: str,
    service: str,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> int:
    """Runs the process's worker until SIGTERM / SIGINT (see the module docstring); exit status.
    ``service``: the full gRPC service name, for the readiness answer of ``grpc.health.v1``."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started, _ = await _first(worker.start(), stop)
    if not started:
        log.info("%s: stopped while loading", name)
        return 0
    draining = False
    health = HealthReporter(service, worker.live, lambda: worker.ready() and not draining)
    server = grpc.aio.server(interceptors=list(interceptors))
    add_servicer(server)
    health.add_to(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    reporting = asyncio.create_task(health.run())
    http = None
    if metrics_port is not None and registry is not None:
        http = MetricsServer(registry, host, metrics_port)
    log.info("%s serving on %s:%d; metrics: %s", name, host, bound,
             f"{host}:{http.port}" if http is not None else "off")
    print(f"READY {host}:{bound}", flush=True)
    try:
        await stop.wait()
        stop.clear()
        draining = True
        await health.update()
        log.info("%s draining (up to %.0f s; another signal stops it at once)", name, drain_timeout_s)
        drained, left = await _first(worker.drain(drain_timeout_s), stop)
        if not drained:
            log.warning("%s: drain cut short by a second signal", name)
        elif left:
            log.warning("%s: %d requests still running after the drain; ending them", name, left)
    finally:
        log.info("%s stopping", name)
        reporting.cancel()
        await worker.close()
        await server.stop(GRACE_S)
        if http is not None:
            http.close()
        log.info("%s stopped", name)
    return 0


async def _first(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """(True, ``work``'s result), or (False, None) with ``work`` cancelled when ``stop`` is set first."""
    task, stopped = asyncio.ensure_future(work), asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        return False, None
    return True, task.result()  # a load error ends the process here, with its traceback
