"""LocalPrefill: the policy alone (no I/O). The backend's use of it is in test_router_grpc_backend.py,
real workers in test_workers_disaggregated.py::test_local_prefill."""

from __future__ import annotations

import pytest

from glmserve.services.router.local_prefill import LocalPrefill, LocalPrefillConfig


def test_auto_goes_local_only_when_the_decode_worker_would_finish_before_the_prefill_worker_starts():
    lp = LocalPrefill()
    assert lp.choose("d1", 100, remote_queued=0) is None  # nothing queued: disaggregate
    assert lp.choose("d1", 100, remote_queued=99) is None
    assert lp.choose("d1", 100, remote_queued=100) == "backlog"
    lp.acquire("d1", 100)
    assert lp.choose("d1", 100, remote_queued=150) is None  # d1's own queue counts
    assert lp.choose("d2", 100, remote_queued=150) == "backlog"  # per decode worker
    assert lp.choose("d1", 100, remote_queued=200) == "backlog"
    lp.release("d1", 100)
    assert lp.queued("d1") == 0 and lp.choose("d1", 100, remote_queued=100) == "backlog"
    lp.release("d1", 5)  # never below zero
    assert lp.queued("d1") == 0


def test_the_decode_workers_own_hit_is_not_counted_as_work():
    lp = LocalPrefill()
    assert lp.choose("d1", 1000, remote_queued=300) is None
    assert lp.choose("d1", 1000, remote_queued=300, own_hit_tokens=700) == "backlog"  # 300 to compute
    assert lp.choose("d1", 1000, remote_queued=299, own_hit_tokens=700) is None
    lp.acquire("d1", 300)  # the backend queues what is computed, not the whole prompt
    assert lp.choose("d1", 1000, remote_queued=599, own_hit_tokens=700) is None
    assert lp.choose("d1", 1000, remote_queued=600, own_hit_tokens=700) == "backlog"


def test_short_prompts_and_the_fixed_modes():
    short = LocalPrefill(LocalPrefillConfig(short_tokens=64))
    assert short.choose("d", 64, remote_queued=0) == "short"
    assert short.choose("d", 65, remote_queued=0) is None
    assert LocalPrefill(LocalPrefillConfig("off")).choose("d", 1, remote_queued=10**6) is None
    assert LocalPrefill(LocalPrefillConfig("always")).choose("d", 10**6, remote_queued=0) == "always"


@pytest.mark.parametrize("kwargs", [{"mode": "sometimes"}, {"short_tokens": -1}])
def test_bad_settings_name_the_field(kwargs):
    with pytest.raises(ValueError, match="local_prefill"):
        LocalPrefillConfig(**kwargs)
