"""TransferTimeline: how much of a LayerSplit prefill's KV transfer stayed on the critical path.

Every stage writes its KV into the decode worker's blocks while the replica still computes later
chunks; what is left of the transfer once the last chunk is computed delays the first token. From
the stages' timestamps (``time.monotonic``, one clock for every process of a host):

- ``busy_s``: the wall time during which at least one KV write of the request was in flight;
- ``exposed_s``: the part of it after the last stage computed its last chunk;
- ``hidden`` = 1 - exposed / busy: the share of the transfer that overlapped compute.

The head observes both per request in ``glmserve_layersplit_kv_transfer_seconds`` and
``glmserve_layersplit_kv_transfer_exposed_seconds``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from glmserve.services.prefill.stage_job import StageOutcome

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class TransferTimeline:
    busy_s: float
    exposed_s: float
    num_bytes: int

    @property
    def hidden(self) -> float:
        return 1.0 - self.exposed_s / self.busy_s if self.busy_s > 0 else 1.0

    @classmethod
    def of(cls, outcomes: Sequence[StageOutcome]) -> TransferTimeline:
        computed = max(o.computed_at for o in outcomes)
        busy = exposed = 0.0
        end = float("-inf")
        for start, finish in sorted((s, f) for o in outcomes for s, f, _ in o.writes):
            start = max(start, end)  # the union of the intervals: count overlaps once
            if finish > start:
                busy += finish - start
                exposed += max(0.0, finish - max(start, computed))
                end = finish
        return cls(busy, exposed, sum(b for o in outcomes for _, _, b in o.writes))


class TimelineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.busy = Histogram("glmserve_layersplit_kv_transfer_seconds",
                              "LayerSplit: per request, wall time any stage's KV write to decode was in flight.",
                              buckets=_BUCKETS, registry=registry)
        self.exposed = Histogram("glmserve_layersplit_kv_transfer_exposed_seconds",
                                 "LayerSplit: per request, KV transfer time left after the last chunk was computed.",
                                 buckets=_BUCKETS, registry=registry)

    def observe(self, timeline: TransferTimeline) -> None:
        self.busy.observe(timeline.busy_s)
        self.exposed.observe(timeline.exposed_s)
