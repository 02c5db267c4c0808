"""Router metrics (prometheus-client), one `CollectorRegistry` per app so apps and tests never share
counters. Names follow Prometheus conventions: `glmserve_router_*`, base units, `_total` counters.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)


class RouterMetrics:
    """All router metrics; `requests_total` is labelled by the HTTP status answered (499: the client
    went away first, as nginx counts it)."""

    def __init__(self) -> None:
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
            "glmserve_router_requests", "Requests answered, by HTTP status.", ["status"], registry=r
        )
        self.prompt_tokens = Counter(
            "glmserve_router_prompt_tokens", "Prompt tokens of accepted requests.", registry=r
        )
        self.generation_tokens = Counter("glmserve_router_generation_tokens", "Tokens generated.", registry=r)
        self.running = Gauge("glmserve_router_requests_running", "Requests generating now.", registry=r)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def count(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def track(self, num_prompt_tokens: int, arrival: float | None = None) -> RequestTracker:
        """Start timing an accepted request; ``arrival``: its `time.monotonic()` arrival (default now)."""
        return RequestTracker(self, num_prompt_tokens, arrival)


class RequestTracker:
    """Timing of one request: `on_tokens` per backend event with tokens, `finish` exactly once."""

    def __init__(self, metrics: RouterMetrics, num_prompt_tokens: int, arrival: float | None = None) -> None:
        self._m = metrics
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
        self._m.count(status)
