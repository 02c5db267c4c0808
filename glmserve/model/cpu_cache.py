"""The size of this CPU's per-core L2 cache, which sizes the tiles of kernels whose temporaries should stay in it."""

from __future__ import annotations

from functools import cache
from pathlib import Path

CPU0_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
DEFAULT_L2_BYTES = 1 << 20  # where sysfs does not say (1 MiB: AMD Zen 4; Intel server cores have 2 MiB)


@cache
def l2_bytes(caches: Path = CPU0_CACHES) -> int:
    """Bytes of the first CPU's level-2 cache, from sysfs; DEFAULT_L2_BYTES where it cannot be read."""
    for index in sorted(caches.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                return parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return DEFAULT_L2_BYTES


def parse_size(text: str) -> int:
    """sysfs cache sizes: '2048K', '1M', or plain bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale
