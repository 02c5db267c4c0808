"""l2_bytes reads the level-2 cache's size from sysfs and falls back where it cannot."""

from __future__ import annotations

from glmserve.model.cpu_cache import DEFAULT_L2_BYTES, l2_bytes, parse_size


def _cache_dir(root, index: int, level: str, size: str) -> None:
    d = root / f"index{index}"
    d.mkdir()
    (d / "level").write_text(level + "\n")
    (d / "size").write_text(size + "\n")


def test_the_level_2_entry_gives_the_size(tmp_path):
    _cache_dir(tmp_path, 0, "1", "48K")
    _cache_dir(tmp_path, 1, "1", "64K")
    _cache_dir(tmp_path, 2, "2", "2048K")
    _cache_dir(tmp_path, 3, "3", "491520K")
    assert l2_bytes(tmp_path) == 2 << 20


def test_without_sysfs_the_default(tmp_path):
    assert l2_bytes(tmp_path / "missing") == DEFAULT_L2_BYTES
    _cache_dir(tmp_path, 2, "2", "lots")
    assert l2_bytes(tmp_path) == DEFAULT_L2_BYTES


def test_sizes_in_sysfs_units():
    assert parse_size("1M") == 1 << 20
    assert parse_size("512K") == 512 << 10
    assert parse_size("4096") == 4096
