"""Aggregates of a set of `RequestRecord`s: latency percentiles, throughput, goodput under SLOs,
cache reuse. Latencies and throughput count completed (``ok``) requests; cancelled ones are
counted apart and never as errors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from glmserve.loadgen.request_record import RequestRecord

_SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(a.max())}


@dataclass(frozen=True)
class SLO:
    """Latency bounds in seconds a request must meet to count toward goodput (None: no bound).
    ``itl`` bounds a request's worst gap between chunks."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for key in _SLO_KEYS:
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"slo.{key}: must be > 0 seconds, got {value}")

    @classmethod
    def from_arg(cls, text: str | None) -> SLO:
        """``"ttft=2,tpot=0.05"`` (seconds; ``ms`` suffix for milliseconds)."""
        if not text:
            return cls()
        bounds: dict[str, float] = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = key.strip().lower().removesuffix("_s")
            if key not in _SLO_KEYS or not value:
                raise ValueError(f"slo: expected KEY=SECONDS with KEY in {', '.join(_SLO_KEYS)}, got {part!r}")
            value = value.strip()
            try:
                seconds = float(value[:-2]) / 1000 if value.endswith("ms") else float(value.removesuffix("s"))
            except ValueError as e:
                raise ValueError(f"slo: {key}: not a number of seconds: {value!r}") from e
            bounds[key] = seconds
        return cls(**bounds)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in _SLO_KEYS if getattr(self, k) is not None}

    def met(self, r: RequestRecord) -> bool:
        if r.status != "ok":
            return False
        checks = ((self.ttft, r.ttft_s), (self.tpot, r.tpot_s), (self.e2e, r.e2e_s),
                  (self.itl, max(r.itl_s) if r.itl_s else 0.0))
        return all(bound is None or (value is not None and value <= bound) for bound, value in checks)


def max_concurrency(records: Sequence[RequestRecord]) -> int:
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def summarize(records: Sequence[RequestRecord], slo: SLO = SLO()) -> dict[str, Any]:
    ok = [r for r in records if r.status == "ok"]
    duration = (max(r.end_s for r in records) - min(r.start_s for r in records)) if records else 0.0
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    prompt = sum(r.prompt_tokens or 0 for r in ok if r.cached_tokens is not None)
    cached = sum(r.cached_tokens or 0 for r in ok if r.cached_tokens is not None)
    output = sum(r.output_tokens or 0 for r in ok)
    chunk_tokens = [t for r in ok for t in (r.chunk_tokens or [])]
    good = sum(slo.met(r) for r in records)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(r.status == "error" for r in records),
        "cancelled": sum(r.status == "cancelled" for r in records),
        "errors_by_kind": dict(Counter(r.error_kind for r in records if r.status == "error")),
        "duration_s": duration,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([g for r in ok for g in r.itl_s]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prompt_tokens": sum(r.prompt_length or 0 for r in ok),
        "output_tokens": output,
        "cached_tokens": cached,
        "cached_token_ratio": cached / prompt if prompt else 0.0,
        "output_tokens_per_s": per_s(output),
        "total_tokens_per_s": per_s(output + sum(r.prompt_length or 0 for r in ok)),
        "requests_per_s": per_s(len(ok)),
        "tokens_per_chunk_mean": float(np.mean(chunk_tokens)) if chunk_tokens else None,
        "max_concurrency": max_concurrency(records),
        "slo": slo.as_dict(),
        "goodput_requests_per_s": per_s(good),
        "goodput_fraction": good / len(records) if records else 0.0,
    }
