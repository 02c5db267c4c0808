"""Prometheus metrics of the prefill and decode workers, one `CollectorRegistry` per worker.

Counters and histograms move with the work (the worker code calls them on its event loop);
gauges and the speculative acceptance histogram are read from the engine's latest
`EngineSnapshot` at scrape time, so a scrape never waits for an engine step. The registry's
``target_info`` carries the worker's role and id.

Names (base units, ``_total`` counters):
- ``glmserve_worker_time_to_first_token_seconds``, ``glmserve_worker_inter_token_latency_seconds``,
  ``glmserve_worker_e2e_request_latency_seconds`` (decode: Generate arrival to first / between /
  last token)
- ``glmserve_worker_requests_running``, ``glmserve_worker_requests_waiting``
- ``glmserve_kv_blocks_used``, ``glmserve_kv_blocks_free``
- ``glmserve_kv_transfer_bytes_total``, ``glmserve_kv_transfer_seconds`` (writer: prefill),
  ``glmserve_kv_transfer_failures_total{reason}`` (both sides), ``glmserve_kv_transfer_stale_total``
  (decode: completions of an old generation, ignored)
- ``glmserve_aborts_total{stage,reason}``
- ``glmserve_spec_acceptance_length`` (tokens gained per decode verify step, 1 + accepted drafts),
  ``glmserve_spec_draft_length`` (the k chosen per verified drafting step),
  ``glmserve_spec_draft_tokens_total`` / ``glmserve_spec_accepted_tokens_total`` (drafting steps only)
- ``glmserve_worker_prompt_tokens_total``, ``glmserve_worker_generation_tokens_total``
- ``glmserve_worker_request_queue_time_seconds`` (prefill: arrival to first scheduled; decode: arrival
  to its blocks reserved), ``glmserve_worker_request_prefill_time_seconds`` (prefill: scheduled to the
  prompt's KV computed), ``glmserve_worker_request_decode_time_seconds`` (decode: first to last token)
- ``glmserve_worker_preemptions_total``, ``glmserve_kv_evictions_total``, ``glmserve_kv_cache_usage_ratio``
- ``glmserve_kv_transfer_deferred_releases_total`` (decode: blocks freed only after the agreed
  timeout, because a writer may still write into them)
- ``process_*`` and ``glmserve_build_info{role,version}`` (`metrics_exposition.add_process_metrics`)

Labelled counters export every known label value from the start (`ABORT_STAGES`, `ABORT_REASONS`,
`TRANSFER_FAILURE_REASONS`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from glmserve.services.engine_snapshot import EngineSnapshot
from glmserve.services.metrics_exposition import add_process_metrics

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8)
_DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8)
_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ABORT_STAGES = {"prefill": ("connect", "load", "compute", "transfer"), "decode": ("queued", "prefill", "decode")}
ABORT_REASONS = {"prefill": ("abort_rpc", "caller_cancelled", "shutdown"),
                 "decode": ("abort_rpc", "cancelled", "shutdown")}
TRANSFER_FAILURE_REASONS = {"prefill": ("writer",), "decode": ("stamp", "peer_gone", "not_drained")}


class _SnapshotCollector(Collector):
    """Gauges and the acceptance histogram from the engine's latest snapshot."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], role: str) -> None:
        self._snapshot, self._role = snapshot, role

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        s = self._snapshot()
        # Prefill: held requests are still in flight (their transfer); decode: reservations wait.
        waiting = s.waiting + (s.reserved if self._role == "decode" else 0)
        running = s.running + (s.held if self._role == "prefill" else 0)
        for name, doc, value in (
            ("glmserve_worker_requests_running", "Requests the engine is working on.", running),
            ("glmserve_worker_requests_waiting", "Requests waiting (for a slot, or for their KV).", waiting),
            ("glmserve_kv_blocks_used", "KV blocks with an owner.", s.used_blocks),
            ("glmserve_kv_blocks_free", "KV blocks free or only prefix-cached.", s.free_blocks),
            ("glmserve_kv_cache_usage_ratio", "KV blocks with an owner / all KV blocks.",
             s.used_blocks / s.total_blocks if s.total_blocks else 0.0),
        ):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family
        for name, doc, value in (
            ("glmserve_worker_preemptions", "Requests preempted (blocks ran out; recomputed later).",
             s.preemptions),
            ("glmserve_kv_evictions", "Cached KV blocks evicted to make room.", s.evictions),
            ("glmserve_spec_draft_tokens", "MTP draft tokens verified (drafting steps only).", s.draft_tokens),
            ("glmserve_spec_accepted_tokens", "MTP draft tokens accepted.", s.accepted_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=float(value))
        yield _histogram("glmserve_spec_acceptance_length",
                         "Tokens gained per decode verify step (1 + accepted drafts).",
                         _ACCEPT_BUCKETS, s.acceptance_lengths)
        yield _histogram("glmserve_spec_draft_length", "Draft length k chosen, per verified drafting step.",
                         _DRAFT_BUCKETS, s.draft_lengths)


def _histogram(name: str, doc: str, bounds: tuple[int, ...], counts: dict[int, int]) -> HistogramMetricFamily:
    """A histogram of integer observations ``counts`` (value -> how often)."""
    buckets = [(str(float(b)), float(sum(n for k, n in counts.items() if k <= b))) for b in bounds]
    buckets.append(("+Inf", float(sum(counts.values()))))
    family = HistogramMetricFamily(name, doc)
    family.add_metric([], buckets, sum_value=float(sum(k * n for k, n in counts.items())))
    return family


class WorkerMetrics:
    """All metrics of one worker; ``registry`` is what the HTTP exporter serves."""

    def __init__(self, role: str, worker_id: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
        self.registry = CollectorRegistry(target_info={"role": role, "worker_id": worker_id})
        r = self.registry
        self.ttft = Histogram("glmserve_worker_time_to_first_token_seconds",
                              "Generate arrival to its first token.", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("glmserve_worker_inter_token_latency_seconds",
                             "Time between consecutive tokens of a request.", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("glmserve_worker_e2e_request_latency_seconds",
                             "Generate arrival to its last event.", buckets=_E2E_BUCKETS, registry=r)
        self.transfer_bytes = Counter("glmserve_kv_transfer_bytes", "KV bytes written to decode workers.",
                                      registry=r)
        self.transfer_seconds = Histogram("glmserve_kv_transfer_seconds", "KV write start to done.",
                                          buckets=_TRANSFER_BUCKETS, registry=r)
        self.transfer_failures = Counter("glmserve_kv_transfer_failures", "KV transfers that failed, by reason.",
                                         ["reason"], registry=r)
        self.transfer_stale = Counter("glmserve_kv_transfer_stale",
                                      "Transfer completions ignored: old generation or unknown request.",
                                      registry=r)
        self.aborts = Counter("glmserve_aborts", "Requests aborted, by stage and reason.",
                              ["stage", "reason"], registry=r)
        self.prompt_tokens = Counter("glmserve_worker_prompt_tokens", "Prompt tokens of accepted requests.",
                                     registry=r)
        self.generation_tokens = Counter("glmserve_worker_generation_tokens", "Tokens generated.", registry=r)
        self.local_prefills = Counter("glmserve_decode_local_prefills",
                                      "Requests a decode worker prefilled itself (the router chose local prefill).",
                                      registry=r)
        self.queue_time = Histogram("glmserve_worker_request_queue_time_seconds",
                                    "Arrival at this worker to first scheduled.", buckets=_PHASE_BUCKETS, registry=r)
        self.prefill_time = Histogram("glmserve_worker_request_prefill_time_seconds",
                                      "Scheduled to the prompt's KV computed.", buckets=_PHASE_BUCKETS, registry=r)
        self.decode_time = Histogram("glmserve_worker_request_decode_time_seconds",
                                     "First token to the last.", buckets=_E2E_BUCKETS, registry=r)
        self.deferred_releases = Counter("glmserve_kv_transfer_deferred_releases",
                                         "Blocks freed only after the agreed timeout (a writer may still write).",
                                         registry=r)
        for stage in ABORT_STAGES[role]:
            for reason in ABORT_REASONS[role]:
                self.aborts.labels(stage=stage, reason=reason)
        for reason in TRANSFER_FAILURE_REASONS[role]:
            self.transfer_failures.labels(reason=reason)
        r.register(_SnapshotCollector(snapshot, role))
        add_process_metrics(r, role)

    def abort(self, stage: str, reason: str) -> None:
        self.aborts.labels(stage=stage, reason=reason).inc()

    def transfer_failed(self, reason: str) -> None:
        self.transfer_failures.labels(reason=reason).inc()


class TokenTimer:
    """TTFT / ITL / end-to-end timing of one decode request: ``on_tokens`` per event with tokens,
    ``finish`` once."""

    def __init__(self, metrics: WorkerMetrics, arrival: float | None = None) -> None:
        self._m = metrics
        self._start = self._last = time.monotonic() if arrival is None else arrival
        self._first = True
        self._first_at: float | None = None
        self._queued = False

    def scheduled(self) -> None:
        """The request got its blocks (the end of its queue time); counted once."""
        if not self._queued:
            self._queued = True
            self._m.queue_time.observe(time.monotonic() - self._start)

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self._first:
            self._m.ttft.observe(now - self._start)
            self._first, self._first_at = False, now
        else:
            gap = (now - self._last) / n  # a speculative step brings several tokens: spread the gap
            for _ in range(n):
                self._m.itl.observe(gap)
        self._last = now
        self._m.generation_tokens.inc(n)

    def finish(self) -> None:
        self._m.e2e.observe(time.monotonic() - self._start)
        if self._first_at is not None:
            self._m.decode_time.observe(self._last - self._first_at)
