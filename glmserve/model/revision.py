"""model_revision: a digest that names exactly which weights a checkpoint directory holds.

It covers config.json, the weight index and every safetensors header (names, dtypes, shapes,
offsets). Headers do not cover weight values, so for checkpoints up to FULL_HASH_LIMIT bytes the
weight files are hashed whole; for larger ones pass an explicit revision (e.g. the hub commit id).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

FULL_HASH_LIMIT = 256 * 2**20
_FILES = ("config.json", "model.safetensors.index.json")


def model_revision(model_dir: str | Path, explicit: str | None = None) -> str:
    if explicit:
        return explicit
    d = Path(model_dir)
    h = hashlib.sha256(b"glmserve-revision-1\0")
    for name in _FILES:
        if (d / name).exists():
            h.update(name.encode() + b"\0" + (d / name).read_bytes())
    weights = sorted(d.glob("*.safetensors"))
    whole = sum(f.stat().st_size for f in weights) <= FULL_HASH_LIMIT
    for f in weights:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            if whole:
                for chunk in iter(lambda: fh.read(2**20), b""):
                    h.update(chunk)
            else:
                (size,) = struct.unpack("<Q", fh.read(8))
                h.update(fh.read(size))
    return h.hexdigest()[:32]
