"""Prometheus metrics of the kvstore service, in a registry of their own (no global state).

Counters move with the RPCs; the index gauges (``glmserve_kvstore_indexed_blocks{tier}``,
``glmserve_kvstore_index_up``) are read from the index at scrape time, so they are right for a
Redis index that other processes also write.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from glmserve.kv.block_index import BlockIndex, IndexUnavailable, Tier
from glmserve.services.kvstore.host_tier import HostTier


class _IndexCollector(Collector):
    def __init__(self, index: BlockIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("glmserve_kvstore_index_up",
                               "1 when the block index backend is reachable, else 0")
        try:
            counts = self._index.block_counts()
        except IndexUnavailable:
            counts = None
        up.add_metric([], 1.0 if counts is not None else 0.0)
        yield up
        if counts is not None:
            blocks = GaugeMetricFamily("glmserve_kvstore_indexed_blocks",
                                       "Indexed (worker, block) entries per tier", labels=["tier"])
            for tier in Tier:
                blocks.add_metric([tier.value], float(counts[tier]))
            yield blocks


class _HostTierCollector(Collector):
    """Host-tier gauges and counters, read from the tier at scrape time."""

    def __init__(self, host: HostTier) -> None:
        self._host = host

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._host.stats()
        if s is None:  # no worker attached yet: the tier has no size
            return
        for name, doc, value in (
            ("glmserve_host_tier_capacity_blocks", "Blocks the host tier can hold.", s.capacity_blocks),
            ("glmserve_host_tier_blocks", "Blocks stored on the host tier.", s.stored_blocks),
            ("glmserve_host_tier_bytes", "Bytes of the blocks stored on the host tier.",
             s.stored_blocks * s.block_bytes),
            ("glmserve_host_tier_capacity_bytes", "Bytes the host tier can hold.",
             s.capacity_blocks * s.block_bytes),
            ("glmserve_host_tier_pinned_blocks", "Host blocks being written or read.", s.pinned_blocks),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], float(value))
            yield gauge
        for name, doc, value in (
            ("glmserve_host_tier_evictions", "Host blocks evicted (LRU) to make room.", s.evictions),
            ("glmserve_host_tier_expired_leases", "Host-tier leases ended by their timeout.", s.expired_leases),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], float(value))
            yield counter


class KVStoreMetrics:
    """The service's metrics; ``registry`` is what the HTTP exporter serves."""

    def __init__(self, index: BlockIndex, registry: CollectorRegistry | None = None,
                 host_tier: HostTier | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.events = Counter("glmserve_kvstore_events", "Block events applied to the index, by kind",
                              ["kind"], registry=self.registry)
        self.lookups = Counter("glmserve_kvstore_lookups", "Prefix lookups answered",
                               registry=self.registry)
        self.rpc_errors = Counter("glmserve_kvstore_rpc_errors", "RPCs that failed, by method and gRPC code",
                                  ["rpc", "code"], registry=self.registry)
        for kind in ("stored", "removed"):
            self.events.labels(kind=kind)  # export zeros before the first event
        self.registry.register(_IndexCollector(index))
        if host_tier is not None:
            self.registry.register(_HostTierCollector(host_tier))
