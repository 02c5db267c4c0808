"""ExpiringMap: entries expire a TTL after they were written; the oldest go first at either bound."""

from __future__ import annotations

import pytest

from glmserve.core.expiring_map import ExpiringMap


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_after_their_ttl():
    clock = Clock()
    m = ExpiringMap(clock=clock)
    m.put("a", b"1", ttl_s=10)
    m.put("b", b"2", ttl_s=20)
    clock.now = 10
    assert m.get("a") is None and m.get("b") == b"2" and len(m) == 1
    m.put("b", b"22", ttl_s=5)  # a rewrite restarts the TTL and replaces the bytes
    assert m.num_bytes == 2
    clock.now = 15
    assert m.get("b") is None and m.num_bytes == 0


def test_bounds_drop_the_oldest_first():
    m = ExpiringMap(max_entries=2, max_bytes=10)
    m.put("a", b"x", 60)
    m.put("b", b"x", 60)
    m.put("c", b"x", 60)
    assert [m.get(k) for k in "abc"] == [None, b"x", b"x"]
    m.put("d", b"1234567890", 60)  # 1 + 10 > 10 bytes: only d is left
    assert m.get("c") is None and m.get("d") is not None and m.num_bytes == 10
    assert not m.put("e", b"x" * 11, 60) and m.get("e") is None


def test_delete_forgets_an_entry_and_says_whether_it_was_there():
    clock = Clock()
    m = ExpiringMap(clock=clock)
    m.put("a", b"123", 10)
    m.put("b", b"4", 5)
    assert m.delete("a") and m.get("a") is None and m.num_bytes == 1
    assert not m.delete("a") and not m.delete("never")
    clock.now = 5
    assert not m.delete("b") and len(m) == 0 and m.num_bytes == 0  # expired: as good as gone


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="max_entries"):
        ExpiringMap(max_entries=0)
    with pytest.raises(ValueError, match="ttl_s"):
        ExpiringMap().put("a", b"", 0)
