"""Which network interfaces carry an address: UCX listens per interface, not per address.

A NIXL agent's UCX TCP transport opens a listening socket on every network device it may use
(UCX_NET_DEVICES, default: all of them), so a worker bound to 127.0.0.1 still listened on the
machine's external address. ``interfaces_for(host)`` names the interfaces that hold ``host``'s
address, for UCX_NET_DEVICES; None for a wildcard host (0.0.0.0, ::, "": every interface is meant).
Linux only (SIOCGIFADDR and /proc/net/if_inet6); elsewhere no restriction is possible and None is
returned for every host, which the caller logs.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import sys
from pathlib import Path

_SIOCGIFADDR = 0x8915
_WILDCARDS = ("", "0.0.0.0", "::", "*")


def _ipv4_of(name: str) -> str | None:
    """The interface's IPv4 address, None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_by_interface() -> dict[str, set[str]]:
    table: dict[str, set[str]] = {}
    path = Path("/proc/net/if_inet6")
    if not path.exists():
        return table
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) == 6:
            address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            table.setdefault(fields[5], set()).add(address)
    return table


def interface_addresses() -> dict[str, set[str]]:
    """Every interface's addresses (IPv4 primary address and IPv6 addresses)."""
    table = _ipv6_by_interface()
    for _, name in socket.if_nameindex():
        v4 = _ipv4_of(name)
        if v4 is not None:
            table.setdefault(name, set()).add(v4)
    return table


def interfaces_for(host: str) -> list[str] | None:
    """Names of the interfaces holding ``host`` (an address or a resolvable name), sorted; None for
    a wildcard host or off Linux. ``ValueError`` naming ``host`` when no interface holds it."""
    if host in _WILDCARDS or not sys.platform.startswith("linux"):
        return None
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e}") from None
    wanted = {str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos}
    names = sorted(name for name, addrs in interface_addresses().items() if addrs & wanted)
    if not names:
        raise ValueError(f"host: no network interface has the address {host!r}")
    return names
