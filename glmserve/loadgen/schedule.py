"""When each request of a run is sent: the trace's own timestamps times ``time_scale``, or a
given rate (Poisson or evenly spaced arrivals), or all at once (``rate`` inf: as fast as the
concurrency limit allows)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from glmserve.loadgen.synthetic_text import seeded

ARRIVALS = ("poisson", "constant")


def parse_rates(text: str | None) -> tuple[float | None, ...]:
    """``--rate``: None (trace timestamps), ``"4"``, ``"inf"``, or a sweep ``"1,2,4"``."""
    if text is None:
        return (None,)
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError as e:
            raise ValueError(f"rate: expected requests per second (or inf), got {part!r}") from e
        if not rate > 0:
            raise ValueError(f"rate: must be > 0, got {part!r}")
        rates.append(rate)
    return tuple(rates)


def rate_label(rate: float | None) -> str:
    return "trace" if rate is None else ("max" if math.isinf(rate) else f"{rate:g}/s")


def send_offsets(timestamps_s: Sequence[float], rate: float | None, time_scale: float = 1.0,
                 arrival: str = "poisson", seed: int = 0) -> list[float]:
    """Seconds after the section start at which each request is due."""
    if time_scale < 0:
        raise ValueError(f"time_scale: must be >= 0, got {time_scale}")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival: must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    n = len(timestamps_s)
    if rate is None:
        first = timestamps_s[0] if n else 0.0
        return [(t - first) * time_scale for t in timestamps_s]
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "constant":
        return [i / rate for i in range(n)]
    rng, t, out = seeded("arrivals", seed, rate), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
