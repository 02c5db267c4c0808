"""The router process: ``python -m glmserve.services.router.main --model DIR --host H --port P
--decode host:port[,host:port...] --prefill host:port[,...] [--kvstore host:port] [--api-key K ...]``.

Serves the OpenAI API (`app.create_app`) over a `DisaggregatedBackend`; with ``--kvstore``, the
stored responses of ``/v1/responses`` live in the kvstore (so every router replica reads them).
The tokenizer, chat template and context length come from ``--model`` (no weights are read; torch
is never imported).
``--port 0`` takes a free port. Prints ``READY http://host:port`` on stdout once it accepts HTTP
(``/ready`` turns 200 when a prefill and a decode worker answer Health).

Overload: the admission queue (``--max-running``, ``--max-queued``, ``--max-queued-per-tenant``,
``--max-queue-wait-s``; `AdmissionConfig` has the defaults) answers 429 / 503 with ``Retry-After``.
SIGTERM / SIGINT drain it: ``/ready`` fails and new requests get 503 at once, running ones may
finish for ``--drain-timeout-s``, what is left then ends with an OpenAI error (an SSE error event
and ``[DONE]``, or a JSON 503); only then does uvicorn close its connections, and the process
exits with status 0. A second signal stops it at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from glmserve.services.router.admission import AdmissionConfig
from glmserve.services.router.app import DEFAULT_MAX_BODY_BYTES, create_app
from glmserve.services.router.chat_output import REASONING_PARSERS
from glmserve.services.router.grpc_backend import DisaggregatedBackend
from glmserve.services.router.local_prefill import MODES as LOCAL_PREFILL_MODES
from glmserve.services.router.local_prefill import LocalPrefillConfig
from glmserve.services.router.prefill_routing import POLICIES, RoutingConfig
from glmserve.services.router.responses_store import KVStoreResponseStore
from glmserve.services.router.worker_pool import check_address
from glmserve.services.tracing import Tracing
from glmserve.text.tokenizer import Tokenizer

log = logging.getLogger("glmserve.router")


def address_list(value: str) -> list[str]:
    return [check_address(a.strip()) for a in value.split(",") if a.strip()]


@dataclass(frozen=True)
class RouterConfig:
    model: Path
    decode: tuple[str, ...]
    prefill: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed in the READY line)
    kvstore: str | None = None
    api_keys: tuple[str, ...] = field(default=())
    served_model_name: str | None = None  # default: the model directory's name
    poll_interval_s: float = 0.5
    graceful_shutdown_s: float = 5.0  # after the drain: closing idle connections
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    local_prefill: LocalPrefillConfig = field(default_factory=LocalPrefillConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    drain_timeout_s: float = 30.0  # on SIGTERM, how long running requests may finish
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    reasoning_parser: str = "glm45"  # "none": reasoning stays in the content unless a request asks
    migration_limit: int = 3  # a stream resumes on another decode worker at most this often (0: never)

    def __post_init__(self) -> None:
        if not (self.model / "config.json").is_file():
            raise ValueError(f"model: no config.json in {self.model}")
        if not self.decode:
            raise ValueError("decode: at least one decode worker address is needed")
        if not self.prefill:
            raise ValueError("prefill: at least one prefill worker address is needed")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.kvstore is not None:
            check_address(self.kvstore)
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {self.poll_interval_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit: must be >= 0, got {self.migration_limit}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be >= 1024, got {self.max_body_bytes}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> RouterConfig:
        p = argparse.ArgumentParser(prog="python -m glmserve.services.router.main",
                                    description="glmserve router: the OpenAI API over prefill/decode workers")
        p.add_argument("--model", type=Path, required=True, help="model dir (tokenizer, config)")
        p.add_argument("--host", default=cls.host)
        p.add_argument("--port", type=int, default=cls.port)
        p.add_argument("--decode", type=address_list, required=True, help="host:port[,host:port...]")
        p.add_argument("--prefill", type=address_list, required=True, help="host:port[,host:port...]")
        p.add_argument("--kvstore", default=None, help="host:port of the kvstore service")
        p.add_argument("--api-key", action="append", default=[], dest="api_keys",
                       help="require this key (repeatable)")
        p.add_argument("--served-model-name", default=None)
        p.add_argument("--poll-interval", type=float, default=cls.poll_interval_s, dest="poll_interval_s")
        r = RoutingConfig()
        p.add_argument("--session-ttl-s", type=float, default=r.session_ttl_s,
                       help="how long an agent session stays on its prefill worker after a turn")
        p.add_argument("--max-imbalance", type=int, default=r.max_imbalance,
                       help="requests of extra load a cache hit or a session may buy")
        p.add_argument("--host-credit", type=float, default=r.host_credit,
                       help="fraction of a host-tier hit counted as saved prefill (device hits: 1)")
        p.add_argument("--shared-prefix-fraction", type=float, default=r.shared_prefix_fraction,
                       help="a hit below this fraction of the prompt does not justify a busier worker")
        p.add_argument("--routing", choices=POLICIES, default=r.policy,
                       help="prefill choice: by cached prefix and load, by load alone, or in turn")
        lp = LocalPrefillConfig()
        p.add_argument("--local-prefill", choices=LOCAL_PREFILL_MODES, default=lp.mode,
                       help="auto: a decode worker prefills a prompt itself when it would finish it before the "
                            "prefill worker could start it (a backlog there); off: never; always: every prompt")
        p.add_argument("--local-prefill-short-tokens", type=int, default=lp.short_tokens,
                       help="with auto, prompts of at most this many tokens are prefilled locally (0: none)")
        q = AdmissionConfig()
        p.add_argument("--max-running", type=int, default=q.max_running, help="requests running at once")
        p.add_argument("--max-queued", type=int, default=q.max_queued, help="requests waiting (then 429)")
        p.add_argument("--max-queued-per-tenant", type=int, default=q.max_queued_per_tenant,
                       help="one API key's share of the queue")
        p.add_argument("--max-queue-wait-s", type=float, default=q.max_wait_s,
                       help="longest wait for a place (and for a full decode worker) before a 429")
        p.add_argument("--drain-timeout-s", type=float, default=cls.drain_timeout_s,
                       help="on SIGTERM, how long running requests may finish before they are ended")
        p.add_argument("--max-body-bytes", type=int, default=cls.max_body_bytes,
                       help="larger request bodies are refused with 413 before they are read")
        p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=cls.reasoning_parser,
                       help="glm45: chat answers carry <think> blocks as reasoning_content (a request's "
                            "separate_reasoning overrides); none: they stay in the content")
        p.add_argument("--migration-limit", type=int, default=cls.migration_limit,
                       help="how often a stream whose decode worker died may resume on another one "
                       "(0: never; the stream then ends with an error event)")
        a = p.parse_args(argv)
        routing = RoutingConfig(host_credit=a.host_credit, max_imbalance=a.max_imbalance,
                                shared_prefix_fraction=a.shared_prefix_fraction, session_ttl_s=a.session_ttl_s,
                                policy=a.routing)
        admission = AdmissionConfig(max_running=a.max_running, max_queued=a.max_queued,
                                    max_queued_per_tenant=a.max_queued_per_tenant, max_wait_s=a.max_queue_wait_s)
        return cls(a.model, tuple(a.decode), tuple(a.prefill), a.host, a.port, a.kvstore,
                   tuple(a.api_keys), a.served_model_name, a.poll_interval_s, routing=routing,
                   local_prefill=LocalPrefillConfig(a.local_prefill, a.local_prefill_short_tokens),
                   admission=admission, drain_timeout_s=a.drain_timeout_s, max_body_bytes=a.max_body_bytes,
                   reasoning_parser=a.reasoning_parser, migration_limit=a.migration_limit)


class _Server(uvicorn.Server):
    """uvicorn's server, except for signals: the first SIGTERM / SIGINT runs ``drain`` (a
    coroutine) on the server's loop and only then stops uvicorn; a second one stops it at once.
    The stop ends with status 0 (uvicorn re-raises the signal after its shutdown, which a launcher
    would read as a crash: 143)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        super().__init__(config)
        self._drain, self._draining = drain, False
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        previous = {sig: signal.signal(sig, lambda s, f: loop.call_soon_threadsafe(self._signalled, s, f))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _signalled(self, sig: int, frame: Any) -> None:
        if self._draining:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        task = asyncio.get_running_loop().create_task(self._drain_then_exit())
        self._tasks.add(task)  # a reference, so the task is not collected mid-way

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:  # a bug in the drain must not keep the process up
            log.exception("drain failed")
        self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket bound now, so the port (free one for 0) is known before serving."""
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections of a TCP
    # socket; with Nagle on, a stream's first SSE chunk waited behind the response headers for the
    # client's delayed ACK (~40 ms on every keep-alive connection).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def serve(config: RouterConfig) -> bool:
    """Run the router until SIGTERM / SIGINT (uvicorn's handlers); False if it never started."""
    model_config = json.loads((config.model / "config.json").read_text())
    tokenizer = await asyncio.to_thread(Tokenizer.from_dir, config.model)
    backend = DisaggregatedBackend(config.decode, config.prefill, config.kvstore,
                                   poll_interval_s=config.poll_interval_s, routing=config.routing,
                                   local_prefill=config.local_prefill,
                                   migration_limit=config.migration_limit,
                                   tracing=Tracing.from_env("router"))
    app = create_app(backend, tokenizer, model_name=config.served_model_name or config.model.name,
                     api_keys=list(config.api_keys) or None,
                     max_context=model_config["max_position_embeddings"], admission=config.admission,
                     max_body_bytes=config.max_body_bytes,
                     # Stored responses where every replica reads them (else in this process).
                     response_store=KVStoreResponseStore(config.kvstore) if config.kvstore else None,
                     separate_reasoning=config.reasoning_parser != "none")
    sock = _bind(config.host, config.port)
    port = sock.getsockname()[1]
    async def drain() -> None:
        log.info("router draining (up to %.0f s; another signal stops it at once)", config.drain_timeout_s)
        ended = await app.state.serving.drain(config.drain_timeout_s)
        log.info("router drained (%d requests ended by the drain timeout)", ended)

    server = _Server(uvicorn.Config(app, log_level="warning",
                                    timeout_graceful_shutdown=config.graceful_shutdown_s), drain)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        url = f"http://{config.host}:{port}"
        log.info("router serving at %s; decode %s; prefill %s; kvstore %s", url, ",".join(config.decode),
                 ",".join(config.prefill), config.kvstore or "none")
        print(f"READY {url}", flush=True)
    await serving
    return server.started


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = RouterConfig.from_args(argv)
    except ValueError as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    if not asyncio.run(serve(config)):
        log.error("router failed to start")
        return 1
    log.info("router stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
