"""TransferStamp: encoding, validation, and the receiver's check before it uses transferred blocks."""

from __future__ import annotations

import pytest
import torch

from glmserve.kv.transfer import (
    ChecksumMismatchError,
    StaleTransferError,
    StampPart,
    TransferStamp,
    block_checksum,
    verify_stamp,
)
from glmserve.kv.transfer.stamp import CHECKSUM_SIZE


def cache(num_blocks: int = 6, values: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, values, generator=gen).to(torch.bfloat16)


def test_encode_decode_round_trip():
    buffer = cache()
    for stamp in (TransferStamp("req-1", 0), TransferStamp("req-é", 7).with_checksum(buffer, [2, 0])):
        data = stamp.encode()
        assert isinstance(data, bytes) and len(data) < 200
        assert TransferStamp.decode(data) == stamp


@pytest.mark.parametrize(
    "data", [b"", b"not json", b"[]", b'{"r": "x"}', b'{"r": "", "g": 0}', b'{"r": "x", "g": 1, "c": "zz"}']
)
def test_decode_rejects_garbage(data):
    with pytest.raises(ValueError, match="stamp"):
        TransferStamp.decode(data)


@pytest.mark.parametrize(
    "args, field",
    [
        (("", 0), "request_id"),
        ((3, 0), "request_id"),
        (("r", -1), "generation"),
        (("r", True), "generation"),
        (("r", 1.0), "generation"),
        (("r", 0, b"short"), "checksum"),
    ],
)
def test_invalid_fields_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        TransferStamp(*args)


def test_overlong_request_id_is_refused_at_encode():
    with pytest.raises(ValueError, match="request_id"):
        TransferStamp("x" * 2000, 0).encode()


def test_checksum_covers_bytes_and_order():
    buffer = cache()
    digest = block_checksum(buffer, [1, 3])
    assert len(digest) == CHECKSUM_SIZE
    assert digest == block_checksum(buffer.clone(), [1, 3])
    assert digest != block_checksum(buffer, [3, 1])
    changed = buffer.clone()
    changed.view(torch.int16)[3, 5] ^= 1  # one bit
    assert digest != block_checksum(changed, [1, 3])


def test_verify_accepts_only_the_current_generation_of_the_request():
    src, dst = cache(seed=1), cache(seed=2)
    stamp = TransferStamp("req-1", 5).with_checksum(src, [4, 1])
    dst[[0, 3]] = src[[4, 1]]  # what a transfer into blocks [0, 3] leaves
    verify_stamp(stamp, request_id="req-1", generation=5, buffer=dst, block_ids=[0, 3])
    with pytest.raises(StaleTransferError, match="stale generation 5"):
        verify_stamp(stamp, request_id="req-1", generation=6, buffer=dst, block_ids=[0, 3])
    with pytest.raises(StaleTransferError, match="ahead"):
        verify_stamp(stamp, request_id="req-1", generation=4)
    with pytest.raises(StaleTransferError, match="req-2"):
        verify_stamp(stamp, request_id="req-2", generation=5)
    with pytest.raises(ChecksumMismatchError):
        verify_stamp(stamp, request_id="req-1", generation=5, buffer=dst, block_ids=[3, 0])


def test_verify_without_checksum_or_buffer_checks_the_ids_only():
    verify_stamp(TransferStamp("r", 1), request_id="r", generation=1, buffer=cache(), block_ids=[0])
    stamped = TransferStamp("r", 1).with_checksum(cache(), [0])
    verify_stamp(stamped, request_id="r", generation=1)  # no buffer given: no checksum pass


def test_a_part_round_trips_and_its_checksum_covers_its_window():
    part = StampPart(stage=1, stages=2, chunk=3, chunks=4, first_block=8, num_blocks=2, offset=16, length=32)
    buffer = torch.arange(4 * 64, dtype=torch.int32).view(4, 64)
    stamp = TransferStamp("r", 2, part=part).with_checksum(buffer, [1, 3], 16, 32)
    assert TransferStamp.decode(stamp.encode()) == stamp and stamp.part == part
    verify_stamp(stamp, request_id="r", generation=2, buffer=buffer, block_ids=[1, 3])
    buffer[1, 0] = -1  # outside the window (bytes 0..3): still the same part
    verify_stamp(stamp, request_id="r", generation=2, buffer=buffer, block_ids=[1, 3])
    buffer[1, 5] = -1  # byte 20: inside
    with pytest.raises(ChecksumMismatchError):
        verify_stamp(stamp, request_id="r", generation=2, buffer=buffer, block_ids=[1, 3])
    with pytest.raises(ValueError, match="part"):
        StampPart(stage=2, stages=2, chunk=0, chunks=1, first_block=0, num_blocks=1)
