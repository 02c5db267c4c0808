"""The admission queue's metrics on the router's ``/metrics``: ``glmserve_router_queue_length``,
``glmserve_router_queue_wait_seconds`` and ``glmserve_router_rejections_total{reason}`` (every
reason has a series from the start, so rate() and alerts see zeros, not gaps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REASONS = ("queue_full", "tenant_cap", "queue_timeout", "draining", "gone", "no_worker", "too_large", "invalid")
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queued = Gauge("glmserve_router_queue_length", "Requests waiting in the admission queue.",
                            registry=registry)
        self.wait = Histogram("glmserve_router_queue_wait_seconds",
                              "Time requests spent in the admission queue (those that had to wait).",
                              buckets=_WAIT_BUCKETS, registry=registry)
        self.rejections = Counter("glmserve_router_rejections",
                                  "Requests refused before they started, by reason.", ["reason"], registry=registry)
        for reason in REASONS:
            self.rejections.labels(reason=reason)
