"""Router metrics (prometheus-client), one `CollectorRegistry` per app so apps and tests never share
counters. Names follow Prometheus conventions: `glmserve_router_*`, base units, `_total` counters;
`render()` adds the served `model_name` to every sample (docs/metrics.md lists them all).

`requests_total{endpoint,status}` counts answers of the API routes only (`ENDPOINTS`; a 404 for an
unknown path is not a request of any endpoint); `request_success_total{finished_reason}` the requests
that finished generating; `rejections_total{reason}` those refused before any work.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram

from glmserve.services.metrics_exposition import add_process_metrics, labelled, render

ENDPOINTS = {"/v1/chat/completions": "chat_completions", "/v1/completions": "completions", "/v1/models": "models",
             "/v1/responses": "responses", "/v1/messages": "messages"}
FINISH_REASONS = ("stop", "length")
# Statuses every generating endpoint exports from the start: a counter series born at its first
# increment has no rate() for that increment (a burst of 503s would never show).
STATUSES = ("200", "400", "413", "429", "499", "500", "503")
# no_worker: 503 while no prefill or decode worker is ready; the rest: the admission queue
# (`admission.py`) and the edge limits (413 too_large, 400 invalid)
REJECTION_REASONS = ("no_worker", "queue_full", "tenant_cap", "queue_timeout", "draining", "gone",
                     "too_large", "invalid")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)


class RouterMetrics:
    """All router metrics; `requests_total` is labelled by the HTTP status answered (499: the client
    went away first, as nginx counts it)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "glmserve_router_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "glmserve_router_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "glmserve_router_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "glmserve_router_requests", "API requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"], registry=r
        )
        self.success = Counter("glmserve_router_request_success", "Requests that finished generating, by why.",
                               ["finished_reason"], registry=r)
        self.rejections = Counter("glmserve_router_rejections", "Requests refused before any work, by reason.",
                                  ["reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason=reason)
        for endpoint in ENDPOINTS.values():
            for status in STATUSES if endpoint != "models" else ("200",):
                self.requests.labels(endpoint=endpoint, status=status)
        self.prompt_tokens = Counter(
            "glmserve_router_prompt_tokens", "Prompt tokens of accepted requests.", registry=r
        )
        self.generation_tokens = Counter("glmserve_router_generation_tokens", "Tokens generated.", registry=r)
        self.running = Gauge("glmserve_router_requests_running", "Requests generating now.", registry=r)
        add_process_metrics(r, "router")

    def render(self, *more: CollectorRegistry) -> tuple[bytes, str]:
        """The Prometheus text exposition of these metrics and ``more`` (distinct names), with
        ``model_name`` on every sample, and its content type."""
        labels = {"model_name": self.model_name}
        return b"".join(render(labelled(reg, labels)) for reg in (self.registry, *more)), CONTENT_TYPE_LATEST

    def count(self, status: int, path: str) -> None:
        """An answer to ``path``; counted when it is an API endpoint."""
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def finished(self, reason: str | None) -> None:
        if reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason).inc()

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def track(self, num_prompt_tokens: int, arrival: float | None = None, path: str = "") -> RequestTracker:
        """Start timing an accepted request to ``path``; ``arrival``: its `time.monotonic()` arrival
        (default now)."""
        return RequestTracker(self, num_prompt_tokens, arrival, path)


class RequestTracker:
    """Timing of one request: `on_tokens` per backend event with tokens, `finish` exactly once."""

    def __init__(self, metrics: RouterMetrics, num_prompt_tokens: int, arrival: float | None = None,
                 path: str = "") -> None:
        self._m, self._path = metrics, path
        self._start = self._last = time.monotonic() if arrival is None else arrival
        self._first = True
        self._done = False
        metrics.prompt_tokens.inc(num_prompt_tokens)
        metrics.running.inc()

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self._first:
            self._m.ttft.observe(now - self._start)
            self._first = False
        else:
            # Speculative steps bring several tokens at once: spread the gap over them.
            gap = (now - self._last) / n
            for _ in range(n):
                self._m.itl.observe(gap)
        self._last = now
        self._m.generation_tokens.inc(n)

    def finish(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        self._m.e2e.observe(time.monotonic() - self._start)
        self._m.running.dec()
        self._m.count(status, self._path)
