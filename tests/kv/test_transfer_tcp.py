"""TCP KV transfer between two real processes on 127.0.0.1, plus the backend contract helpers."""

from __future__ import annotations

import time

import pytest

from glmserve.kv.transfer import TransferHandle, TransferStamp, make_backend
from glmserve.kv.transfer.base import check_block_ids, memcpy_throughput
from glmserve.kv.transfer.tcp_backend import TcpTransferBackend
from tests.kv.transfer_peer import (
    ReceiverProcess,
    check_cancel_drains,
    check_exact_write,
    check_peer_death,
    check_window_write,
    make_source,
)

NUM_BLOCKS, BLOCK_BYTES = 80, 1 << 20
DYING_BLOCKS, DYING_BLOCK_BYTES = 512, 128 << 10  # 64 MiB in small blocks: a write with many steps


@pytest.fixture(scope="module")
def receivers():
    """The main receiver and one to kill, started together (their imports overlap)."""
    main = ReceiverProcess.launch("tcp", NUM_BLOCKS, BLOCK_BYTES)
    dying = ReceiverProcess.launch("tcp", DYING_BLOCKS, DYING_BLOCK_BYTES, seed=7)
    yield main, dying
    main.stop()
    dying.stop()


@pytest.fixture(scope="module")
def receiver(receivers):
    return receivers[0].ready()


@pytest.fixture(scope="module")
def writer(receiver):
    src = make_source(NUM_BLOCKS, BLOCK_BYTES)
    backend = TcpTransferBackend(chunk_bytes=256 << 10)  # small frames: cancel lands mid-write
    backend.register(src)
    peer = backend.connect(receiver.target_info)
    yield backend, peer, src
    backend.close()


def test_write_lands_exactly_and_stamp_verifies(writer, receiver):
    backend, peer, src = writer
    check_exact_write(backend, peer, receiver, src)
    assert backend.connect(receiver.target_info) == peer  # cached


def test_a_window_moves_only_its_bytes(receiver):
    def writer(src):
        backend = TcpTransferBackend(chunk_bytes=100_000)  # frames that do not divide the window
        backend.register(src)
        return backend

    check_window_write(writer, receiver, BLOCK_BYTES)


def test_cancel_drains_a_64mib_write(writer, receiver):
    backend, peer, _ = writer
    landed, error = check_cancel_drains(backend, peer, receiver)
    assert 0 < landed < 64 and error == "cancelled"


def test_peer_death_fails_the_write_promptly(receivers):
    backend = TcpTransferBackend(chunk_bytes=64 << 10)
    backend.register(make_source(DYING_BLOCKS, DYING_BLOCK_BYTES))
    try:
        assert check_peer_death(backend, receivers[1]) < 5.0
    finally:
        start = time.monotonic()
        backend.close()
        assert time.monotonic() - start < 5.0


def test_throughput_helper_reports_bytes_per_second(writer):
    from glmserve.kv.transfer import measure_write_throughput

    backend, peer, _ = writer
    ids = list(range(16))
    rate = measure_write_throughput(backend, peer, ids, ids, repeats=2)
    copy = memcpy_throughput(16, BLOCK_BYTES, repeats=2)
    print(f"\nTCP {rate / 1e9:.2f} GB/s, memcpy {copy / 1e9:.2f} GB/s (16 x 1 MiB)")
    assert rate > 0 and copy > 0


# -- contract helpers (no second process) -----------------------------------------------------------


def test_block_ids_are_validated():
    assert check_block_ids([1, 2], [5, 0], 4, 6) == ([1, 2], [5, 0])
    for src, dst, field in (
        ([1], [1, 2], "dst_block_ids"),
        ([], [], "dst_block_ids"),
        ([4], [0], "src_block_ids"),
        ([0], [6], "dst_block_ids"),
        ([0, 1], [3, 3], "dst_block_ids"),
        ([True], [0], "src_block_ids"),
    ):
        with pytest.raises(ValueError, match=field):
            check_block_ids(src, dst, 4, 6)


def test_handle_state_only_moves_forward():
    handle = TransferHandle(TransferStamp("r", 0), "peer", 1, 10)
    assert handle.state == "pending" and not handle.drained
    assert handle.finish("failed", "boom", drained=False)
    assert not handle.finish("done")
    assert handle.state == "failed" and handle.error == "boom" and not handle.drained


def test_make_backend_rejects_unknown_kind():
    with pytest.raises(ValueError, match="transfer"):
        make_backend("carrier-pigeon")
    backend = make_backend("tcp")
    assert backend.kind == "tcp"
    backend.close()


def test_write_to_unknown_peer_and_bad_buffers_are_rejected():
    backend = TcpTransferBackend()
    with pytest.raises(ValueError, match="buffer"):
        backend.register(make_source(4, 64).t())  # not contiguous
    backend.register(make_source(4, 64))
    with pytest.raises(ValueError, match="peer"):
        backend.write("nowhere:1", TransferStamp("r", 0), [0], [0])
    with pytest.raises(ValueError, match="target_info"):
        backend.connect(b'{"kind": "nixl"}')
    backend.close()
