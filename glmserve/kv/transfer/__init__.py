"""KV transfer: moving whole KV blocks from a prefill worker's cache into a decode worker's cache.

``make_backend("auto" | "nixl" | "tcp")`` picks the implementation; the contract is in ``base``.
"""

from __future__ import annotations

import logging
from typing import Any

from glmserve.kv.transfer.base import (
    BlockWindow,
    KVTransferBackend,
    TransferDrainError,
    TransferError,
    TransferHandle,
    TransferState,
    measure_write_throughput,
    memcpy_throughput,
)
from glmserve.kv.transfer.stamp import (
    ChecksumMismatchError,
    StaleTransferError,
    StampError,
    StampPart,
    TransferStamp,
    block_checksum,
    verify_stamp,
)

logger = logging.getLogger(__name__)

BACKEND_KINDS = ("auto", "nixl", "tcp")

__all__ = [
    "BACKEND_KINDS",
    "BlockWindow",
    "ChecksumMismatchError",
    "KVTransferBackend",
    "StaleTransferError",
    "StampError",
    "StampPart",
    "TransferDrainError",
    "TransferError",
    "TransferHandle",
    "TransferStamp",
    "TransferState",
    "block_checksum",
    "make_backend",
    "measure_write_throughput",
    "memcpy_throughput",
    "nixl_unavailable_reason",
    "verify_stamp",
]


def nixl_unavailable_reason() -> str | None:
    """None when ``nixl`` imports here, else why not (for logs and test skips)."""
    try:
        from glmserve.kv.transfer.nixl_backend import import_nixl

        import_nixl()
    except Exception as e:  # ImportError, or a missing shared library / plugin
        return f"{type(e).__name__}: {e}"
    return None


def make_backend(kind: str = "auto", host: str | None = None, **options: Any) -> KVTransferBackend:
    """A transfer backend: ``nixl``, ``tcp``, or ``auto`` (NIXL when it imports, else TCP).
    ``host``: the interface the backend listens on (a TCP receiver binds it; NIXL's UCX listens
    only on the interfaces holding it); ``options`` go to the backend's constructor (e.g.
    ``timeout_s``: writes are failed and fenced after it). The choice is logged."""
    if kind not in BACKEND_KINDS:
        raise ValueError(f"transfer: must be one of {', '.join(BACKEND_KINDS)}, got {kind!r}")
    if kind == "auto":
        reason = nixl_unavailable_reason()
        kind = "nixl" if reason is None else "tcp"
        if reason is not None:
            logger.info("KV transfer: NIXL unavailable (%s), using TCP", reason)
    if kind == "nixl":
        from glmserve.kv.transfer.nixl_backend import NixlTransferBackend

        backend: KVTransferBackend = NixlTransferBackend(**options, **({"host": host} if host is not None else {}))
    else:
        from glmserve.kv.transfer.tcp_backend import TcpTransferBackend

        backend = TcpTransferBackend(**options, **({"host": host} if host is not None else {}))
    logger.info("KV transfer backend: %s", backend.kind)
    return backend
