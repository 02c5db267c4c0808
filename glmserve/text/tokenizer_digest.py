"""tokenizer_digest: a digest naming exactly which tokenizer (and chat template) a model dir holds.

It goes into the prefix-cache root (``CacheKeyRoot.tokenizer_digest``): the router, which
tokenizes, and the workers, which cache KV by token ids, each compute it from their own copy of the
model dir, so a worker whose tokenizer differs never matches the router's hashes. Hashes the raw
bytes of the tokenizer files that exist (sha256, each file named, so moving bytes between files
changes the digest).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_digest(model_dir: str | Path) -> str:
    """32 hex chars; ValueError naming ``model_dir`` when it has no ``tokenizer.json``."""
    d = Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"model_dir: {d} has no tokenizer.json")
    h = hashlib.sha256(b"glmserve-tokenizer-1\0")
    for name in TOKENIZER_FILES:
        f = d / name
        if f.is_file():
            data = f.read_bytes()
            h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:32]
