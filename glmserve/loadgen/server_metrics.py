"""Snapshots of the server's Prometheus ``/metrics`` before and after a run, and what changed:
the deltas of counters (``_total``, ``_count``, ``_sum`` samples) and the final value of gauges
that moved. A server without ``/metrics`` gives no snapshot, not an error."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_COUNTER_SUFFIXES = ("_total", "_count", "_sum")


async def snapshot(http: httpx.AsyncClient) -> str | None:
    try:
        response = await http.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):  # per-bucket detail; creation timestamps
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metrics_delta(before: str | None, after: str | None) -> dict[str, Any]:
    if before is None or after is None:
        return {}
    old, new = _samples(before), _samples(after)
    delta = {}
    for key, value in new.items():
        name = key.split("{", 1)[0]
        if name.endswith(_COUNTER_SUFFIXES):
            change = value - old.get(key, 0.0)
            if change:
                delta[key] = change
        elif old.get(key) != value:
            delta[key] = value
    return dict(sorted(delta.items()))
