"""The admission queue's metrics on the router's ``/metrics``: ``glmserve_router_queue_length`` and
``glmserve_router_queue_wait_seconds``; refusals go to the router's
``glmserve_router_rejections_total{reason}`` (`RouterMetrics.rejected`)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry, rejected: Callable[[str], None]) -> None:
        self.rejected = rejected
        self.queued = Gauge("glmserve_router_queue_length", "Requests waiting in the admission queue.",
                            registry=registry)
        self.wait = Histogram("glmserve_router_queue_wait_seconds",
                              "Time requests spent in the admission queue (those that had to wait).",
                              buckets=_WAIT_BUCKETS, registry=registry)
