"""Prefix-cache keys: golden vectors, isolation (DESIGN invariant 1), chain behaviour, validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path

import pytest

from glmserve.core.block_hash import (
    FORMAT_VERSION,
    HASH_SIZE,
    CacheKeyRoot,
    block_hashes,
    encode_token_ids,
    reusable_blocks,
)

GOLDEN = Path(__file__).with_name("golden_block_hashes.json")
BS = 4


def make_root(**overrides: object) -> CacheKeyRoot:
    fields: dict[str, object] = dict(
        model_revision="sha256:0f1e2d3c",
        tokenizer_digest="sha256:aa55",
        kv_dtype="bfloat16",
        block_size=BS,
        kv_layout_version=1,
    )
    fields.update(overrides)
    return CacheKeyRoot(**fields)  # type: ignore[arg-type]


ROOT = make_root().root_hash()
TOKENS = list(range(100, 100 + 5 * BS + 2))  # 5 full blocks and a partial tail


# -- golden vectors ---------------------------------------------------------------------------------


def _extra_keys(raw: list | None) -> list | None:
    if raw is None:
        return None
    decode = {"bytes": bytes.fromhex, "str": str, "int": int}
    return [
        None if block is None else [(k["name"], decode[k["type"]](k["value"])) for k in block]
        for block in raw
    ]


def test_golden_vectors() -> None:
    doc = json.loads(GOLDEN.read_text())
    assert doc["format_version"] == FORMAT_VERSION, "encoding version changed: regenerate the golden file"
    assert len(doc["cases"]) >= 4
    for case in doc["cases"]:
        root = CacheKeyRoot(**case["root"]).root_hash()
        assert root.hex() == case["root_hash"], case["name"]
        got = block_hashes(
            root,
            case["token_ids"],
            case["root"]["block_size"],
            salt=case["salt"],
            extra_keys=_extra_keys(case["extra_keys"]),
        )
        assert [h.hex() for h in got] == case["block_hashes"], case["name"]


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def test_encoding_matches_the_documented_format() -> None:
    """Rebuild root and first block hash from the module docstring's description alone."""
    root = make_root(kv_layout_version="v7")
    expected_root = hashlib.blake2b(
        b"".join(
            [
                _field(b"i", FORMAT_VERSION.to_bytes(1, "little")),
                _field(b"s", b"sha256:0f1e2d3c"),
                _field(b"s", b"sha256:aa55"),
                _field(b"s", b"bfloat16"),
                _field(b"i", BS.to_bytes(1, "little")),
                _field(b"s", b"v7"),
            ]
        ),
        digest_size=16,
        person=b"glmserve-kvroot",
    ).digest()
    assert root.root_hash() == expected_root
    assert len(expected_root) == HASH_SIZE

    tokens = [1, 2, 70000, 2**32 - 1]
    expected_block = hashlib.blake2b(
        _field(b"b", expected_root)
        + _field(b"s", b"tenant")
        + _field(b"b", struct.pack("<4I", *tokens))
        + _field(b"n", b""),
        digest_size=16,
        person=b"glmserve-kvblock",
    ).digest()
    assert block_hashes(expected_root, tokens, BS, salt="tenant") == [expected_block]


# -- isolation: nothing but the same root, salt and tokens shares a hash ----------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"model_revision": "sha256:0f1e2d3d"},
        {"tokenizer_digest": "sha256:aa56"},
        {"kv_dtype": "float8_e4m3fn"},
        {"kv_layout_version": 2},
        {"kv_layout_version": "1"},  # str "1" is not int 1
    ],
)
def test_root_field_change_shares_no_block(change: dict[str, object]) -> None:
    other = make_root(**change).root_hash()
    assert other != ROOT
    assert not set(block_hashes(other, TOKENS, BS)) & set(block_hashes(ROOT, TOKENS, BS))


def test_block_size_change_shares_no_block() -> None:
    tokens = list(range(48))
    a = block_hashes(make_root(block_size=4).root_hash(), tokens, 4)
    b = block_hashes(make_root(block_size=8).root_hash(), tokens, 8)
    assert not set(a) & set(b)


def test_salt_isolates_tenants_in_every_block() -> None:
    plain = block_hashes(ROOT, TOKENS, BS)
    a = block_hashes(ROOT, TOKENS, BS, salt="tenant-a")
    b = block_hashes(ROOT, TOKENS, BS, salt="tenant-b")
    assert len(plain) == len(a) == len(b) == 5
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)
    assert a == block_hashes(ROOT, TOKENS, BS, salt="tenant-a")  # deterministic


def test_root_is_stable_and_frozen() -> None:
    root = make_root()
    assert root.root_hash() == make_root().root_hash() == ROOT
    with pytest.raises(dataclasses.FrozenInstanceError):
        root.kv_dtype = "float16"  # type: ignore[misc]


# -- the chain --------------------------------------------------------------------------------------


def test_changed_token_changes_its_block_and_all_later_ones_only() -> None:
    base = block_hashes(ROOT, TOKENS, BS)
    for pos in range(5 * BS):
        changed = list(TOKENS)
        changed[pos] += 1
        got = block_hashes(ROOT, changed, BS)
        block = pos // BS
        assert got[:block] == base[:block], pos
        assert all(g != b for g, b in zip(got[block:], base[block:], strict=True)), pos


def test_changed_token_in_partial_tail_changes_nothing() -> None:
    changed = list(TOKENS)
    changed[-1] += 1
    assert block_hashes(ROOT, changed, BS) == block_hashes(ROOT, TOKENS, BS)


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(ROOT, [], BS) == []
    assert block_hashes(ROOT, [1, 2, 3], BS) == []
    full = block_hashes(ROOT, list(range(8)), BS)
    assert len(full) == 2
    for extra in range(1, BS):
        assert block_hashes(ROOT, list(range(8 + extra)), BS) == full


def test_prefix_property() -> None:
    """A longer prompt's hashes extend a shorter one's: what makes prefix lookup work."""
    short = block_hashes(ROOT, TOKENS[: 2 * BS + 1], BS)
    assert block_hashes(ROOT, TOKENS, BS)[:2] == short


def test_same_block_at_other_position_hashes_differently() -> None:
    hashes = block_hashes(ROOT, [7] * (3 * BS), BS)
    assert len(set(hashes)) == 3


def test_token_encoding_is_not_confusable() -> None:
    a = block_hashes(ROOT, [1, 23, 0, 0], BS)
    b = block_hashes(ROOT, [12, 3, 0, 0], BS)
    c = block_hashes(ROOT, [123, 0, 0, 0], BS)
    assert len({a[0], b[0], c[0]}) == 3
    assert encode_token_ids([1, 23]) != encode_token_ids([12, 3])
    assert encode_token_ids([1, 256]) == bytes([1, 0, 0, 0, 0, 1, 0, 0])


def test_accepts_tuples_and_numpy_ints() -> None:
    np = pytest.importorskip("numpy")
    expected = block_hashes(ROOT, TOKENS, BS)
    assert block_hashes(ROOT, tuple(TOKENS), BS) == expected
    assert block_hashes(ROOT, np.array(TOKENS, dtype=np.int64), BS) == expected


# -- extra keys ---------------------------------------------------------------------------------------


def test_extra_keys_enter_only_their_block_and_later() -> None:
    tokens = list(range(3 * BS))
    base = block_hashes(ROOT, tokens, BS)
    assert block_hashes(ROOT, tokens, BS, extra_keys=[None, None, None]) == base
    keyed = block_hashes(ROOT, tokens, BS, extra_keys=[None, [("image", b"\x01")], None])
    assert keyed[0] == base[0]
    assert keyed[1] != base[1] and keyed[2] != base[2]


def test_extra_key_values_are_typed_and_ordered() -> None:
    tokens = list(range(BS))

    def one(keys: list) -> bytes:
        return block_hashes(ROOT, tokens, BS, extra_keys=[keys])[0]

    variants = [
        [("k", 1)],
        [("k", "1")],
        [("k", b"1")],
        [("k", b"\x01")],
        [("k", -1)],
        [("k1", 1)],
        [("a", "bc")],
        [("ab", "c")],
        [("a", 1), ("b", 2)],
        [("b", 2), ("a", 1)],
        [],
    ]
    assert len({one(v) for v in variants}) == len(variants)
    assert one([]) != block_hashes(ROOT, tokens, BS)[0]  # an empty key list is not "no keys"


def test_extra_keys_may_cover_the_partial_tail() -> None:
    tokens = list(range(2 * BS + 1))
    a = block_hashes(ROOT, tokens, BS, extra_keys=[None, None])
    b = block_hashes(ROOT, tokens, BS, extra_keys=[None, None, [("tail", 1)]])
    assert a == b == block_hashes(ROOT, tokens, BS)


# -- reusable blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "block_size", "expected"),
    [(0, 4, 0), (1, 4, 0), (4, 4, 0), (5, 4, 1), (8, 4, 1), (9, 4, 2), (16, 16, 0), (17, 16, 1), (7, 1, 6)],
)
def test_reusable_blocks(n: int, block_size: int, expected: int) -> None:
    assert reusable_blocks(n, block_size) == expected
    assert reusable_blocks(n, block_size) <= len(block_hashes(ROOT, list(range(n)), block_size))


# -- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_revision": ""}, "model_revision"),
        ({"tokenizer_digest": None}, "tokenizer_digest"),
        ({"kv_dtype": ""}, "kv_dtype"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"block_size": 4.0}, "block_size"),
        ({"kv_layout_version": ""}, "kv_layout_version"),
        ({"kv_layout_version": 1.5}, "kv_layout_version"),
        ({"kv_layout_version": False}, "kv_layout_version"),
    ],
)
def test_root_validation_names_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_root(**change)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, -1, 3], r"token_ids\[2\]"),
        ([1, 2, 3, 2**32], r"token_ids\[3\]"),
        ([1.0, 2, 3, 4], r"token_ids\[0\]"),
        ([1, 2, 3, 4, -5], r"token_ids\[4\]"),  # in the partial tail: still rejected
        ([1, 2, 3, 4, "5"], r"token_ids\[4\]"),
    ],
)
def test_bad_token_ids(tokens: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        block_hashes(ROOT, tokens, BS)


def test_max_token_id_is_accepted() -> None:
    assert len(block_hashes(ROOT, [0, 2**32 - 1, 5, 6], BS)) == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"root": b"short"}, "root"),
        ({"root": ROOT.hex()}, "root"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": -4}, "block_size"),
        ({"salt": ""}, "salt"),
        ({"salt": b"tenant"}, "salt"),
        ({"extra_keys": [None]}, "extra_keys"),  # 5 full blocks need >= 5 entries
        ({"extra_keys": [None] * 7}, "extra_keys"),  # at most 6 (with the partial tail)
        ({"extra_keys": [[("k", 1.5)]] + [None] * 4}, r"extra_keys\[0\]\[0\] value"),
        ({"extra_keys": [[("k", True)]] + [None] * 4}, r"extra_keys\[0\]\[0\] value"),
        ({"extra_keys": [None, [("", 1)]] + [None] * 3}, r"extra_keys\[1\]\[0\] name"),
        ({"extra_keys": [None, [("k",)]] + [None] * 3}, r"extra_keys\[1\]\[0\]"),
    ],
)
def test_block_hashes_validation_names_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"root": ROOT, "token_ids": TOKENS, "block_size": BS}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        block_hashes(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "block_size", "field"), [(-1, 4, "num_prompt_tokens"), (4, 0, "block_size")])
def test_reusable_blocks_validation(n: int, block_size: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        reusable_blocks(n, block_size)
