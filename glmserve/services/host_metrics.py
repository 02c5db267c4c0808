"""Host-tier metrics of a prefill or decode worker, registered in the worker's own registry.

- ``glmserve_host_tier_writes_total{kind}`` / ``glmserve_host_tier_write_bytes_total{kind}``: blocks
  (and bytes) this worker wrote to the host tier; ``kind`` is ``write_through`` or ``demotion``
- ``glmserve_host_tier_demotions_total``: device blocks evicted under pressure that were copied to
  the host first; ``glmserve_host_tier_demotions_dropped_total``: evictions with no staging row free
- ``glmserve_host_tier_loadbacks_total``, ``glmserve_host_tier_loadback_blocks_total``,
  ``glmserve_host_tier_loadback_bytes_total``, ``glmserve_host_tier_loadback_seconds``: loads of
  host blocks into this worker's device blocks before prefill
- ``glmserve_host_tier_failures_total{op}``: host-tier operations that failed (the request goes on
  without the host tier)
- ``glmserve_worker_prefix_cache_hit_tokens_total{tier}``: prompt tokens this worker did not
  compute, by the tier they came from (``device``, or ``host`` when loaded back); the router's
  ``glmserve_prefix_cache_hit_tokens_total`` is the cluster-wide figure, a distinct name so that no
  ``sum()`` adds the two
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class HostTierMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.writes = Counter("glmserve_host_tier_writes", "Blocks written to the host tier, by kind.",
                              ["kind"], registry=r)
        self.write_bytes = Counter("glmserve_host_tier_write_bytes", "Bytes written to the host tier, by kind.",
                                   ["kind"], registry=r)
        self.demotions = Counter("glmserve_host_tier_demotions",
                                 "Evicted device blocks copied to the host tier.", registry=r)
        self.demotions_dropped = Counter("glmserve_host_tier_demotions_dropped",
                                         "Evicted device blocks not demoted: no staging row free.", registry=r)
        self.loadbacks = Counter("glmserve_host_tier_loadbacks", "Loads of host blocks before prefill.",
                                 registry=r)
        self.loadback_blocks = Counter("glmserve_host_tier_loadback_blocks", "Blocks loaded from the host tier.",
                                       registry=r)
        self.loadback_bytes = Counter("glmserve_host_tier_loadback_bytes", "Bytes loaded from the host tier.",
                                      registry=r)
        self.loadback_seconds = Histogram("glmserve_host_tier_loadback_seconds",
                                          "Host lookup to loaded blocks, per load.", buckets=_LOAD_BUCKETS,
                                          registry=r)
        self.failures = Counter("glmserve_host_tier_failures", "Host-tier operations that failed, by op.",
                                ["op"], registry=r)
        self.hit_tokens = Counter("glmserve_worker_prefix_cache_hit_tokens",
                                  "Prompt tokens reused from the prefix cache, by tier.", ["tier"], registry=r)
        for kind in ("write_through", "demotion"):
            self.writes.labels(kind=kind)
            self.write_bytes.labels(kind=kind)
        for tier in ("device", "host"):
            self.hit_tokens.labels(tier=tier)
        for op in ("write_through", "demotion", "loadback"):
            self.failures.labels(op=op)

    def count_hits(self, num_cached_tokens: int, host_tokens: int) -> None:
        """Split one request's reused prompt tokens into device and host hits."""
        host = min(num_cached_tokens, host_tokens)
        self.hit_tokens.labels(tier="host").inc(host)
        self.hit_tokens.labels(tier="device").inc(num_cached_tokens - host)
