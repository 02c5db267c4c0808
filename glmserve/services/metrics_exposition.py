"""How every glmserve service exposes Prometheus metrics.

- ``labelled(registry, labels)``: a registry whose every sample also carries ``labels`` (the served
  ``model_name``, and ``role`` on workers and the kvstore), added at scrape time in one place instead of
  on each metric.
- ``add_process_metrics(registry, role)``: the standard ``process_*`` series (restarts show as changes
  of ``process_start_time_seconds`` wherever the service runs), ``glmserve_build_info{role,version}``
  = 1, the series dashboards and alerts join on, and ``glmserve_process_restarts_total``: how often
  `glmserve serve`'s supervisor restarted this service before this process (it passes the count in
  ``GLMSERVE_RESTARTS``), so the series carries on across restarts and ``increase()`` counts them.
- ``MetricsServer``: the HTTP endpoint of the workers and the kvstore on their ``--metrics-port``:
  ``GET /metrics`` and ``HEAD /metrics`` (200, headers only: scrapers such as aiperf probe with HEAD),
  404 elsewhere, on a daemon thread, bound to the service's configured host.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

SERVICE_LABELS = ("model_name", "role")  # what `labelled` adds to every sample of a service
RESTARTS_ENV = "GLMSERVE_RESTARTS"


class _Relabelled(Collector):
    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._registry, self._labels = registry, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**self._labels, **s.labels}, s.value, s.timestamp, s.exemplar)
            yield out


def labelled(registry: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """A registry that serves ``registry``'s metrics with ``labels`` added to every sample."""
    out = CollectorRegistry(auto_describe=False)
    out.register(_Relabelled(registry, labels))
    return out


def package_version() -> str:
    try:
        return version("glmserve")
    except PackageNotFoundError:
        return "unknown"


def add_process_metrics(registry: CollectorRegistry, role: str) -> None:
    ProcessCollector(registry=registry)
    info = Gauge("glmserve_build_info", "1 per process; its labels say what runs.", ["role", "version"],
                 registry=registry)
    info.labels(role=role, version=package_version()).set(1)
    restarts = Counter("glmserve_process_restarts", "Times the launcher restarted this service (glmserve serve).",
                       registry=registry)
    restarts.inc(restarts_so_far())


def restarts_so_far(env: Mapping[str, str] | None = None) -> int:
    """The supervisor's count of this service's earlier restarts (``GLMSERVE_RESTARTS``; 0 if unset)."""
    value = (os.environ if env is None else env).get(RESTARTS_ENV, "0")
    if not value.isdigit():
        raise ValueError(f"{RESTARTS_ENV}: must be a count, got {value!r}")
    return int(value)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, with_body: bool) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                body, status, kind = b"not found\n", 404, "text/plain; charset=utf-8"
            else:
                body, status, kind = render(registry), 200, CONTENT_TYPE_LATEST
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer(with_body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer(with_body=False)

        def log_message(self, format: str, *args: object) -> None:  # scrapes every few seconds: no log
            pass

    return Handler


class MetricsServer:
    """``GET``/``HEAD /metrics`` of ``registry`` on ``host:port`` (0: a free port), until ``close()``."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler(registry))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
