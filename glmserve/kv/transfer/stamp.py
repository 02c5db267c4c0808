"""TransferStamp: the (request id, generation, checksum) every KV transfer carries (DESIGN invariant 3).

The writer attaches a stamp to each write; the receiver gets it back with the completion
notification and calls ``verify_stamp`` before it lets the engine read the blocks. Only the exact
(request id, generation) the receiver allocated the blocks for is accepted: a late completion of an
older generation (a cancelled or retried transfer) is rejected, and state only moves forward.

The optional checksum is BLAKE2b (16 bytes) over the block bytes in transfer order, so a write that
landed partially, in the wrong blocks or with the wrong layout is caught. It costs one pass over the
bytes on each side; leave it off in production paths that trust the transport.

A transfer made of several writes (LayerSplit: each stage writes its slice of the blocks, chunk by
chunk) stamps each write with a `StampPart`: which stage of how many, which chunk of how many,
which of the request's destination blocks and which bytes of each. The receiver uses the blocks only
once every part of every stage has arrived, each verified on its own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glmserve.core.errors import GlmServeError

CHECKSUM_SIZE = 16
_PERSON = b"glmserve-kvxfer"
MAX_ENCODED_BYTES = 1024  # a stamp travels in a NIXL notification: keep it small


class StampError(GlmServeError):
    """A transferred block set must not be used: its stamp does not match what the receiver expects."""


class StaleTransferError(StampError):
    """The stamp names another request, or a generation other than the current one."""


class ChecksumMismatchError(StampError):
    """The bytes in the destination blocks are not the bytes the writer sent."""


@dataclass(frozen=True)
class StampPart:
    """One write of a split transfer (see the module docstring). ``first_block``/``num_blocks``
    index the request's destination blocks; ``offset``/``length`` are the bytes of each destination
    block the write covers (length 0: the whole block)."""

    stage: int
    stages: int
    chunk: int
    chunks: int
    first_block: int
    num_blocks: int
    offset: int = 0
    length: int = 0

    def __post_init__(self) -> None:
        values = (self.stage, self.stages, self.chunk, self.chunks, self.first_block, self.num_blocks,
                  self.offset, self.length)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise ValueError(f"part: every field must be an int >= 0, got {values}")
        if not (self.stage < self.stages and self.chunk < self.chunks):
            raise ValueError(f"part: stage {self.stage} of {self.stages}, chunk {self.chunk} of {self.chunks}")

    def encode(self) -> list[int]:
        return [self.stage, self.stages, self.chunk, self.chunks, self.first_block, self.num_blocks,
                self.offset, self.length]


@dataclass(frozen=True)
class TransferStamp:
    request_id: str
    generation: int
    checksum: bytes | None = None
    part: StampPart | None = None  # None: the transfer is this one write

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id: must be a non-empty str, got {self.request_id!r}")
        if isinstance(self.generation, bool) or not isinstance(self.generation, int) or self.generation < 0:
            raise ValueError(f"generation: must be an int >= 0, got {self.generation!r}")
        if self.checksum is not None and (
            not isinstance(self.checksum, bytes) or len(self.checksum) != CHECKSUM_SIZE
        ):
            raise ValueError(f"checksum: must be None or {CHECKSUM_SIZE} bytes, got {self.checksum!r}")

    def with_checksum(self, buffer: torch.Tensor, block_ids: Sequence[int], offset: int = 0,
                      length: int = 0) -> TransferStamp:
        """This stamp carrying the checksum of ``buffer``'s rows ``block_ids`` (the source blocks;
        bytes ``[offset, +length)`` of each when ``length``)."""
        digest = block_checksum(buffer, block_ids, offset, length)
        return TransferStamp(self.request_id, self.generation, digest, self.part)

    def encode(self) -> bytes:
        """Compact JSON (never pickle: stamps cross process and machine boundaries)."""
        fields: dict[str, object] = {"r": self.request_id, "g": self.generation}
        if self.checksum is not None:
            fields["c"] = self.checksum.hex()
        if self.part is not None:
            fields["p"] = self.part.encode()
        data = json.dumps(fields, separators=(",", ":")).encode()
        if len(data) > MAX_ENCODED_BYTES:
            raise ValueError(f"request_id: too long to encode ({len(data)} > {MAX_ENCODED_BYTES} bytes)")
        return data

    @classmethod
    def decode(cls, data: bytes) -> TransferStamp:
        """Inverse of ``encode``; raises ``ValueError`` on anything else."""
        try:
            fields = json.loads(data)
            checksum, part = fields.get("c"), fields.get("p")
            return cls(fields["r"], fields["g"], bytes.fromhex(checksum) if checksum is not None else None,
                       StampPart(*part) if part is not None else None)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"stamp: cannot decode {data[:64]!r}: {e}") from e


def block_checksum(buffer: torch.Tensor, block_ids: Sequence[int], offset: int = 0, length: int = 0) -> bytes:
    """BLAKE2b-128 of rows ``block_ids`` of a [num_blocks, ...] buffer, in that order (bytes
    ``[offset, +length)`` of each row when ``length``)."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_SIZE, person=_PERSON)
    for block_id in block_ids:
        row = buffer[block_id].contiguous().view(-1).view(torch.uint8)
        if length:
            row = row[offset : offset + length]
        digest.update(memoryview(row.cpu().numpy()))
    return digest.digest()


def verify_stamp(
    stamp: TransferStamp,
    *,
    request_id: str,
    generation: int,
    buffer: torch.Tensor | None = None,
    block_ids: Sequence[int] = (),
) -> None:
    """Raise unless ``stamp`` is for ``request_id`` at exactly ``generation`` and, when it carries a
    checksum, rows ``block_ids`` of ``buffer`` (the destination blocks, in transfer order; for a
    part, its blocks, and the part's bytes of each) match it.

    A stamp with a checksum is verified only when ``buffer`` is given: pass it whenever you have it.
    """
    if stamp.request_id != request_id:
        raise StaleTransferError(f"stamp is for request {stamp.request_id!r}, expected {request_id!r}")
    if stamp.generation < generation:
        raise StaleTransferError(
            f"request {request_id!r}: stale generation {stamp.generation} (current {generation})"
        )
    if stamp.generation > generation:
        raise StaleTransferError(
            f"request {request_id!r}: generation {stamp.generation} is ahead of current {generation}"
        )
    if stamp.checksum is not None and buffer is not None:
        window = (stamp.part.offset, stamp.part.length) if stamp.part is not None else (0, 0)
        actual = block_checksum(buffer, block_ids, *window)
        if actual != stamp.checksum:
            raise ChecksumMismatchError(
                f"request {request_id!r} generation {generation}: checksum {actual.hex()} "
                f"!= stamped {stamp.checksum.hex()}"
            )
