"""The TCP sockets a process listens on, read from /proc (Linux): its socket inodes from
/proc/<pid>/fd, their local addresses from /proc/<pid>/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_LISTEN = "0A"


def _decode(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc stores each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` (any of its threads) listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.add(_decode(fields[1]))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a v6 socket bound to 127.0.0.1
    return (mapped or ip).is_loopback


def non_loopback(addresses: set[tuple[str, int]]) -> set[tuple[str, int]]:
    return {(a, p) for a, p in addresses if not _loopback(a)}
