"""NIXL (UCX) KV transfer between two real processes on this host.

Default UCX transports here: CMA for the data (each chunk is copied inside ``transfer()``), TCP for
notifications. The ``UCX_TLS=tcp`` case makes requests stay in progress, so cancel goes through
NIXL's release of an active request plus our fence.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from glmserve.kv.transfer import memcpy_throughput, nixl_unavailable_reason
from tests.kv.transfer_peer import (
    ReceiverProcess,
    check_cancel_drains,
    check_exact_write,
    check_peer_death,
    check_window_write,
    make_source,
)

_reason = nixl_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"nixl does not import here: {_reason}")

NUM_BLOCKS, BLOCK_BYTES = 80, 1 << 20
DYING_BLOCKS, DYING_BLOCK_BYTES = 512, 128 << 10  # 64 MiB in small blocks: a write with many steps


def nixl_writer(src, **options):
    from glmserve.kv.transfer.nixl_backend import NixlTransferBackend

    backend = NixlTransferBackend(**options)
    backend.register(src)
    return backend


@pytest.fixture(scope="module")
def receivers():
    """The main receiver and one to kill, started together (their imports overlap)."""
    main = ReceiverProcess.launch("nixl", NUM_BLOCKS, BLOCK_BYTES)
    dying = ReceiverProcess.launch("nixl", DYING_BLOCKS, DYING_BLOCK_BYTES, seed=7)
    yield main, dying
    main.stop()
    dying.stop()


@pytest.fixture(scope="module")
def receiver(receivers):
    return receivers[0].ready()


@pytest.fixture(scope="module")
def source():
    return make_source(NUM_BLOCKS, BLOCK_BYTES)


@pytest.fixture(scope="module")
def writer(receiver, source):
    backend = nixl_writer(source, chunk_bytes=2 << 20)  # 2-block chunks: cancel lands mid-write
    yield backend, backend.connect(receiver.target_info)
    backend.close()


def test_write_lands_exactly_and_stamp_verifies(writer, receiver, source):
    backend, peer = writer
    check_exact_write(backend, peer, receiver, source)
    assert backend.connect(receiver.target_info) == peer  # cached


def test_a_window_moves_only_its_bytes(receiver):
    check_window_write(lambda src: nixl_writer(src, chunk_bytes=1 << 20), receiver, BLOCK_BYTES)


def test_cancel_between_chunks_drains_a_64mib_write(writer, receiver):
    backend, peer = writer
    landed, error = check_cancel_drains(backend, peer, receiver)
    assert 0 < landed < 64 and error == "cancelled"


def test_cancel_of_a_request_in_flight_is_fenced(receiver, source, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # no CMA: a posted request stays in progress
    backend = nixl_writer(source, chunk_bytes=64 << 20)  # one request for the whole write
    try:
        peer = backend.connect(receiver.target_info)
        _, error = check_cancel_drains(backend, peer, receiver, after_s=0.01, first_src=8)
        assert error == "cancelled in flight"
    finally:
        backend.close()


def test_peer_death_fails_the_write_promptly(receivers):
    # One block per request: the kill lands between or inside the copies.
    backend = nixl_writer(make_source(DYING_BLOCKS, DYING_BLOCK_BYTES), chunk_bytes=DYING_BLOCK_BYTES)
    try:
        assert check_peer_death(backend, receivers[1]) < 5.0
    finally:
        start = time.monotonic()
        backend.close()
        assert time.monotonic() - start < 5.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_receiver_uses_little_cpu(receiver):
    """NIXL's own progress thread (poll delay 0) took ~0.3-0.5 of a core per idle process, polling
    every millisecond ~2.4%; with no write expected the receiver polls every 20 ms (~0). Own CPU
    time: other load does not count."""
    time.sleep(0.5)  # the previous test's write has settled
    before, start = _cpu_seconds(receiver.process.pid), time.monotonic()
    time.sleep(2.0)
    share = (_cpu_seconds(receiver.process.pid) - before) / (time.monotonic() - start)
    assert share < 0.05, f"an idle NIXL receiver used {share:.0%} of a core"


def test_a_receiver_progresses_often_only_while_writes_are_expected():
    """Polls in 0.3 s: at most one per idle interval (50 ms here) with none expected, many more
    (every millisecond) while one is, and few again once it is final."""
    from glmserve.kv.transfer.nixl_backend import NixlTransferBackend

    backend = NixlTransferBackend(progress_interval_s=0.001, idle_progress_interval_s=0.05)
    polls = []
    try:
        backend.register(make_source(2, 4096))
        backend._read_notifs = lambda: polls.append(time.monotonic())  # counts the progress loop's polls
        backend.target_info()  # a receiver from here on: its progress loop runs

        def polls_in(seconds: float) -> int:
            before = len(polls)
            time.sleep(seconds)
            return len(polls) - before

        idle = polls_in(0.3)
        backend.expect_writes(1)
        expecting = polls_in(0.3)
        backend.expect_writes(-1)
        time.sleep(0.01)
        after = polls_in(0.3)
    finally:
        backend.close()
    assert idle <= 8 and after <= 8, (idle, after)
    assert expecting >= 30, expecting


def test_throughput_helper_reports_bytes_per_second(writer):
    from glmserve.kv.transfer import measure_write_throughput

    backend, peer = writer
    ids = list(range(16))
    rate = measure_write_throughput(backend, peer, ids, ids, repeats=2)
    copy = memcpy_throughput(16, BLOCK_BYTES, repeats=2)
    print(f"\nNIXL {rate / 1e9:.2f} GB/s, memcpy {copy / 1e9:.2f} GB/s (16 x 1 MiB)")
    assert rate > 0 and copy > 0
