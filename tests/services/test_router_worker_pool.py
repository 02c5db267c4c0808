"""WorkerPool: health state, load and choice (pure logic)."""

from __future__ import annotations

import pytest

from glmserve.services.router.worker_pool import HealthReport, WorkerPool, check_address

A, B, C = "127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"


def pool(*addresses: str, free_blocks: int = 10) -> WorkerPool:
    p = WorkerPool("decode", addresses)
    for a in addresses:
        p.report(a, HealthReport(True, free_blocks=free_blocks), p.epoch(a))
    return p


def test_addresses_are_validated() -> None:
    assert check_address("decode-0:50061") == "decode-0:50061"
    for bad in ("nohost", ":80", "h:0", "h:99999", "h:x"):
        with pytest.raises(ValueError, match="address"):
            check_address(bad)
    with pytest.raises(ValueError, match="decode"):
        WorkerPool("decode", [])
    with pytest.raises(ValueError, match="duplicate"):
        WorkerPool("decode", [A, A])


def test_unhealthy_until_a_ready_health_answer() -> None:
    p = WorkerPool("prefill", [A])
    assert not p.any_healthy() and p.choose() is None
    assert p.report(A, HealthReport(False), p.epoch(A)) is False  # answered, but not ready
    assert p.choose() is None and p.views()[0].last_error == "worker reports not ready"
    assert p.report(A, HealthReport(True, "w0"), p.epoch(A)) is True
    assert p.choose() == A and p.views()[0].worker_id == "w0"
    assert p.report(A, None, p.epoch(A), "health: UNAVAILABLE") is True
    assert not p.any_healthy() and p.views()[0].last_error == "health: UNAVAILABLE"


def test_a_failure_outlives_health_answers_from_polls_started_before_it() -> None:
    p = pool(A)
    stale = p.epoch(A)  # a poll in flight when the worker died
    assert p.mark_failed(A, "stream broke") is True
    assert p.mark_failed(A, "again") is False  # already unhealthy
    assert p.report(A, HealthReport(True), stale) is False and not p.is_healthy(A)
    assert p.report(A, HealthReport(True), p.epoch(A)) is True and p.is_healthy(A)


def test_least_loaded_first_counting_local_inflight() -> None:
    p = pool(A, B)
    p.report(A, HealthReport(True, running=3, waiting=1, free_blocks=10), p.epoch(A))
    assert p.choose() == B
    for _ in range(5):  # sent since the last poll: the local count wins over a stale report
        p.acquire(B)
    assert p.choose() == A
    for _ in range(5):
        p.release(B)
    p.release(B)  # never below zero
    assert {v.address: v.inflight for v in p.views()} == {A: 0, B: 0}


def test_free_blocks_break_load_ties_and_a_full_worker_goes_last() -> None:
    p = pool(A, B)
    p.report(B, HealthReport(True, free_blocks=50), p.epoch(B))
    assert p.choose() == B
    p.report(B, HealthReport(True, free_blocks=0), p.epoch(B))
    p.report(A, HealthReport(True, running=9, free_blocks=3), p.epoch(A))
    assert p.choose() == A  # busier, but B has no block left


def test_exact_ties_go_round_robin_and_exclusions_hold() -> None:
    p = pool(A, B, C)
    assert [p.choose() for _ in range(6)] == [A, B, C, A, B, C]
    assert p.choose(exclude=[A]) == B
    assert p.choose(exclude=[A, B, C]) is None
    p.mark_failed(B, "gone")
    assert [p.choose() for _ in range(4)] == [C, A, C, A]


def test_a_slow_answer_is_tolerated_a_refused_connection_is_not() -> None:
    p = pool(A)
    for _ in range(2):  # timed out: maybe busy
        assert p.report(A, None, p.epoch(A), "health: DEADLINE_EXCEEDED", slow=True) is False
        assert p.is_healthy(A)
    assert p.report(A, None, p.epoch(A), "health: DEADLINE_EXCEEDED", slow=True) is True  # third in a row
    assert p.report(A, HealthReport(True), p.epoch(A)) is True
    p.report(A, None, p.epoch(A), "slow", slow=True)
    p.report(A, HealthReport(True), p.epoch(A))  # an answer resets the count
    p.report(A, None, p.epoch(A), "slow", slow=True)
    assert p.is_healthy(A)
    assert p.report(A, None, p.epoch(A), "health: UNAVAILABLE") is True and not p.is_healthy(A)


def test_a_finished_request_is_taken_off_the_last_report() -> None:
    p = WorkerPool("prefill", [A])
    p.acquire(A)
    p.report(A, HealthReport(True, running=1), p.epoch(A))  # polled while the request ran
    p.release(A)
    assert [v.load for v in p.views()] == [0]  # not busy until the next poll
