"""Aggregates from records: counts with cancellations apart from errors, TPOT from usage, SLO
goodput, percentiles, cached-token ratio; arrival schedules and the command-line forms."""

from __future__ import annotations

import math

import pytest

from glmserve.loadgen.request_record import RequestRecord
from glmserve.loadgen.run_summary import SLO, max_concurrency, summarize
from glmserve.loadgen.schedule import parse_rates, send_offsets


def rec(i: int, status: str = "ok", ttft: float = 0.1, e2e: float = 1.0, out: int = 10, start: float = 0.0,
        kind: str | None = None) -> RequestRecord:
    r = RequestRecord(id=i, start_s=start, ttft_s=ttft, e2e_s=e2e, itl_s=[0.1] * (out - 1), prompt_tokens=100,
                      output_tokens=out if status == "ok" else None, cached_tokens=40 if status == "ok" else None,
                      status=status, error_kind=kind)
    r.finish_timing()
    return r


def test_counts_latencies_throughput_and_cache_ratio() -> None:
    records = [rec(0), rec(1, ttft=0.3, e2e=2.0, start=1.0), rec(2, "cancelled"), rec(3, "error", kind="http_503")]
    s = summarize(records, SLO(ttft=0.2))
    assert (s["requests"], s["completed"], s["cancelled"], s["errors"]) == (4, 2, 1, 1)
    assert s["errors_by_kind"] == {"http_503": 1}
    assert s["tpot_s"]["p50"] == pytest.approx(((1.0 - 0.1) / 9 + (2.0 - 0.3) / 9) / 2)
    assert s["ttft_s"]["count"] == 2 and s["ttft_s"]["max"] == pytest.approx(0.3)
    assert s["duration_s"] == pytest.approx(3.0)
    assert s["output_tokens_per_s"] == pytest.approx(20 / 3.0)
    assert s["cached_token_ratio"] == pytest.approx(0.4)
    assert s["goodput_requests_per_s"] == pytest.approx(1 / 3.0) and s["goodput_fraction"] == 0.25
    assert max_concurrency(records) == 3  # 0 ends at 1.0 as 1 starts


def test_slo_and_rate_arguments() -> None:
    assert SLO.from_arg("ttft=2,tpot=50ms,e2e_s=30") == SLO(ttft=2.0, tpot=0.05, e2e=30.0)
    for bad in ("latency=1", "ttft=", "ttft=fast", "ttft=-1"):
        with pytest.raises(ValueError, match="slo"):
            SLO.from_arg(bad)
    assert parse_rates(None) == (None,) and parse_rates("1,2.5,inf") == (1.0, 2.5, math.inf)
    with pytest.raises(ValueError, match="rate"):
        parse_rates("0")


def test_schedules() -> None:
    assert send_offsets([2.0, 3.0, 7.0], None, time_scale=0.5) == [0.0, 0.5, 2.5]
    assert send_offsets([0, 0, 0], 4.0, arrival="constant") == [0.0, 0.25, 0.5]
    assert send_offsets([0, 0], math.inf) == [0.0, 0.0]
    poisson = send_offsets([0.0] * 2000, 10.0, seed=1)
    assert poisson == send_offsets([0.0] * 2000, 10.0, seed=1)
    assert poisson[-1] / 2000 == pytest.approx(0.1, rel=0.1)


def test_the_progress_bar_counts_outcomes(capsys) -> None:
    from glmserve.loadgen.progress import LiveProgress

    with LiveProgress(enabled=True) as progress:
        progress.section("replay trace", 3)
        for status in ("ok", "cancelled", "error"):
            progress.done(rec(0, status))
        assert progress._counts == {"ok": 1, "cancelled": 1, "error": 1}
    assert "replay trace" in capsys.readouterr().out
