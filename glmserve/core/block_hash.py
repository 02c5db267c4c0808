"""Prefix-cache keys: a root that pins everything KV depends on, and a hash chain over full blocks.

Two blocks share a hash only if they were produced under the same root (format version, model
revision, tokenizer, KV dtype, block size, KV layout), under the same tenant salt, with exactly the
same tokens (and extra keys) in this block and in every block before it (DESIGN invariant 1).

Hash function: BLAKE2b with a 16-byte digest (``HASH_SIZE``); the ``person`` parameter separates
root hashes from block hashes. Inputs are a canonical byte encoding: every field is a one-byte
type tag, an 8-byte little-endian length and the payload, so no two different field lists encode
to the same bytes. Token ids are a little-endian uint32 array. Never Python's ``hash()`` (salted
per process), pickle or ``repr`` -- these keys are shared between processes and machines.

Changing anything in the encoding changes every key: bump ``FORMAT_VERSION`` and regenerate the
golden vectors in ``tests/core/golden_block_hashes.json``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

FORMAT_VERSION = 1
HASH_SIZE = 16
MAX_TOKEN_ID = 2**32 - 1

_ROOT_PERSON = b"glmserve-kvroot"
_BLOCK_PERSON = b"glmserve-kvblock"

ExtraKey = tuple[str, bytes | str | int]
"""A named value that, besides the tokens, decides a block's KV (e.g. an image digest, a LoRA id)."""


# -- canonical encoding ---------------------------------------------------------------------------


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def _int_field(value: int) -> bytes:
    # Minimal two's-complement bytes: canonical for any Python int, and the tag keeps 1 != "1".
    return _field(b"i", value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True))


def _str_field(value: str) -> bytes:
    return _field(b"s", value.encode("utf-8"))


def _bytes_field(value: bytes) -> bytes:
    return _field(b"b", value)


_NONE_FIELD = _field(b"n", b"")


def _value_field(value: bytes | str | int, name: str) -> bytes:
    # bool is an int subclass; refusing it keeps True from silently meaning 1.
    if isinstance(value, bool):
        raise ValueError(f"{name}: must be bytes, str or int, not bool")
    if isinstance(value, int):
        return _int_field(value)
    if isinstance(value, str):
        return _str_field(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return _bytes_field(bytes(value))
    raise ValueError(f"{name}: must be bytes, str or int, got {type(value).__name__}")


def _digest(person: bytes, fields: Sequence[bytes]) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_SIZE, person=person)
    for f in fields:
        h.update(f)
    return h.digest()


def encode_token_ids(token_ids: Sequence[int], name: str = "token_ids") -> bytes:
    """Little-endian uint32 array of ``token_ids``; ValueError naming ``name[i]`` if one is out of range."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        pass
    # Slow path only to name the offending element.
    for i, tok in enumerate(token_ids):
        if not isinstance(tok, int):
            try:
                tok = tok.__index__()  # numpy integers and friends
            except (AttributeError, TypeError):
                raise ValueError(f"{name}[{i}]: must be an int, got {type(tok).__name__}") from None
        if not 0 <= tok <= MAX_TOKEN_ID:
            raise ValueError(f"{name}[{i}]: {tok} is outside [0, 2**32)")
    raise ValueError(f"{name}: cannot be encoded as uint32")  # pragma: no cover - defensive


# -- the root -------------------------------------------------------------------------------------


def _require_str(value: object, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty str, got {value!r}")


@dataclass(frozen=True)
class CacheKeyRoot:
    """Everything a block's KV depends on besides its tokens; ``root_hash()`` starts every chain.

    ``FORMAT_VERSION`` (the encoding version of this module) is hashed in as well, so a change of
    encoding never matches keys written by an older one.
    """

    model_revision: str
    """Digest of the checkpoint (weights + config) the KV was computed with."""
    tokenizer_digest: str
    """Digest of the tokenizer (and chat template) that produced the token ids."""
    kv_dtype: str
    """Storage dtype of the KV cache, e.g. ``"bfloat16"``."""
    block_size: int
    """Tokens per block."""
    kv_layout_version: str | int
    """Version of the in-memory KV block layout (per-layer order, indexer keys, padding...)."""

    def __post_init__(self) -> None:
        _require_str(self.model_revision, "model_revision")
        _require_str(self.tokenizer_digest, "tokenizer_digest")
        _require_str(self.kv_dtype, "kv_dtype")
        _check_block_size(self.block_size)
        layout = self.kv_layout_version
        if isinstance(layout, bool) or not isinstance(layout, str | int) or layout == "":
            raise ValueError(f"kv_layout_version: must be a non-empty str or an int, got {layout!r}")

    def encode(self) -> bytes:
        """The canonical byte encoding hashed by ``root_hash``."""
        return b"".join(
            [
                _int_field(FORMAT_VERSION),
                _str_field(self.model_revision),
                _str_field(self.tokenizer_digest),
                _str_field(self.kv_dtype),
                _int_field(self.block_size),
                _value_field(self.kv_layout_version, "kv_layout_version"),
            ]
        )

    def root_hash(self) -> bytes:
        """``HASH_SIZE`` bytes: BLAKE2b of ``encode()``; the parent of a chain's first block."""
        return _digest(_ROOT_PERSON, [self.encode()])


# -- the block chain ------------------------------------------------------------------------------


def _check_block_size(block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be an int >= 1, got {block_size!r}")


def _encode_extra_keys(keys: Sequence[ExtraKey] | None, name: str) -> bytes:
    if keys is None:
        return _NONE_FIELD
    parts = [_int_field(len(keys))]
    for j, item in enumerate(keys):
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"{name}[{j}]: must be a (name, value) tuple, got {item!r}")
        key, value = item
        _require_str(key, f"{name}[{j}] name")
        parts.append(_str_field(key))
        parts.append(_value_field(value, f"{name}[{j}] value"))
    return _field(b"x", b"".join(parts))


def block_hashes(
    root: bytes,
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: str | None = None,
    extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
) -> list[bytes]:
    """Hashes of the FULL blocks of ``token_ids``; a partial last block is not hashed.

    Block i's hash is BLAKE2b over (parent, salt slot, block i's token ids as uint32 LE, block i's
    extra keys), where the parent is ``root`` for block 0 and block i-1's hash after that. The
    tenant ``salt`` fills the salt slot of block 0 only: every later block chains through it, so two
    tenants never share any block.

    ``block_size`` must be the block size ``root`` was made with. ``extra_keys``, when given, holds
    one entry per block (``None`` for a block without extra keys); it must cover every full block
    and may also cover the partial tail (ignored). Within a block, extra keys are hashed in the
    given order, so callers must use a fixed order.
    """
    if not isinstance(root, bytes) or len(root) != HASH_SIZE:
        raise ValueError(f"root: must be {HASH_SIZE} bytes (CacheKeyRoot.root_hash()), got {root!r}")
    _check_block_size(block_size)
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"salt: must be a non-empty str or None, got {salt!r}")
    num_full = len(token_ids) // block_size
    if extra_keys is not None:
        max_blocks = -(-len(token_ids) // block_size)
        if not num_full <= len(extra_keys) <= max_blocks:
            raise ValueError(
                f"extra_keys: has {len(extra_keys)} entries; want one per block "
                f"({num_full} full, {max_blocks} with the partial tail)"
            )
    encoded = encode_token_ids(token_ids)  # the whole prompt, so a bad id in the tail is caught too
    stride = 4 * block_size
    hashes: list[bytes] = []
    parent = root
    for i in range(num_full):
        salt_field = _str_field(salt) if i == 0 and salt is not None else _NONE_FIELD
        keys = None if extra_keys is None else extra_keys[i]
        parent = _digest(
            _BLOCK_PERSON,
            [
                _bytes_field(parent),
                salt_field,
                _bytes_field(encoded[i * stride : (i + 1) * stride]),
                _encode_extra_keys(keys, f"extra_keys[{i}]"),
            ],
        )
        hashes.append(parent)
    return hashes


def reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading prompt blocks may come from the cache: ``floor((n - 1) / block_size)``.

    The last prompt token is always computed (its logits give the first output token), so a prompt
    that is an exact multiple of the block size reuses one block fewer than it has.
    """
    if isinstance(num_prompt_tokens, bool) or not isinstance(num_prompt_tokens, int) or num_prompt_tokens < 0:
        raise ValueError(f"num_prompt_tokens: must be an int >= 0, got {num_prompt_tokens!r}")
    _check_block_size(block_size)
    return max(num_prompt_tokens - 1, 0) // block_size
