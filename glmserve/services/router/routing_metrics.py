"""Prefix-cache and routing metrics of the router's disaggregated backend (own registry; the app
serves them on ``/metrics`` next to its own).

- ``glmserve_prefix_cache_hit_tokens_total{tier="device|host"}``: prompt tokens served from the
  prefix cache, as reported by the prefill workers (the host share is what the routing decision
  expected from the host tier, capped by the reported total).
- ``glmserve_prefix_cache_prompt_tokens_total`` and ``glmserve_prefix_cache_hit_ratio``: the
  denominator, and hit tokens / prompt tokens since start.
- ``glmserve_prefix_cache_lookups_total{source="kvstore|local",result="hit|miss"}``: prompt
  lookups, by where they were answered (the kvstore index, or the router's local view).
- ``glmserve_router_routing_decisions_total{reason}``: prefill choices by reason (see
  ``prefill_routing.REASONS``).
- ``glmserve_router_local_prefills_total{reason}``: requests whose decode worker prefilled the
  prompt itself instead of a prefill worker (see ``local_prefill.REASONS``).
- ``glmserve_router_kv_index_up``: 1 while lookups go to the kvstore index, 0 while the router
  routes from its local view (kvstore or its Redis unreachable, or none configured).
- ``glmserve_router_stream_migrations_total{outcome="resumed|ended"}``: streams that lost their
  decode worker and went on on another one, or ended with an error (no worker, or past the limit).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from glmserve.services.router.local_prefill import REASONS as LOCAL_PREFILL_REASONS
from glmserve.services.router.prefill_routing import REASONS


class RoutingMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.hit_tokens = Counter("glmserve_prefix_cache_hit_tokens",
                                  "Prompt tokens served from the prefix cache, by tier.", ["tier"], registry=r)
        self.prompt_tokens = Counter("glmserve_prefix_cache_prompt_tokens",
                                     "Prompt tokens of requests sent to prefill workers.", registry=r)
        self.hit_ratio = Gauge("glmserve_prefix_cache_hit_ratio",
                               "Prefix-cache hit tokens / prompt tokens since start.", registry=r)
        self.lookups = Counter("glmserve_prefix_cache_lookups", "Prefix lookups, by source and result.",
                               ["source", "result"], registry=r)
        self.decisions = Counter("glmserve_router_routing_decisions",
                                 "Prefill routing decisions, by reason.", ["reason"], registry=r)
        self.local_prefills = Counter("glmserve_router_local_prefills",
                                      "Requests prefilled by their decode worker, by reason.", ["reason"], registry=r)
        self.index_up = Gauge("glmserve_router_kv_index_up",
                              "1: lookups use the kvstore index; 0: the router's local view.", registry=r)
        self.migrations = Counter("glmserve_router_stream_migrations",
                                  "Streams that lost their decode worker: resumed elsewhere, or ended.",
                                  ["outcome"], registry=r)
        for outcome in ("resumed", "ended"):
            self.migrations.labels(outcome=outcome)
        for tier in ("device", "host"):
            self.hit_tokens.labels(tier=tier)
        for reason in REASONS:
            self.decisions.labels(reason=reason)
        for reason in LOCAL_PREFILL_REASONS:
            self.local_prefills.labels(reason=reason)
        self._hits = self._prompts = 0

    def served(self, num_prompt_tokens: int, num_cached: int, expected_host: int) -> None:
        """A prefill finished: ``num_cached`` of its prompt tokens came from the cache."""
        host = min(expected_host, num_cached)
        self.hit_tokens.labels(tier="device").inc(num_cached - host)
        self.hit_tokens.labels(tier="host").inc(host)
        self.prompt_tokens.inc(num_prompt_tokens)
        self._hits += num_cached
        self._prompts += num_prompt_tokens
        self.hit_ratio.set(self._hits / self._prompts if self._prompts else 0.0)
