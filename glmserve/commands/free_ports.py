"""Ports to give a service before it starts: free now, and below the kernel's ephemeral range.

A port from ``bind(port 0)`` lies in the ephemeral range (``ip_local_port_range``), where every
outgoing connection and every other ``bind(0)`` of any process draws its port too: between choosing
such a port and the service binding it, a client socket can take it, and the service dies with
EADDRINUSE at start. Below that range only whoever names a port gets it. A ``PortPicker`` walks that
range from a random start, so one picker never hands out a port twice (until it wraps), and two
pickers in different processes rarely meet.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST_PORT = 20000  # below it: well-known services users may run (databases, 8000-style APIs)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The first port the kernel hands out for ``bind(0)`` and outgoing connections."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class PortPicker:
    """Hands out ports free on ``host``, each at most once per wrap of [LOWEST_PORT, ephemeral_low())."""

    def __init__(self, host: str = "127.0.0.1", seed: int | None = None) -> None:
        self.host = host
        self._high = max(ephemeral_low(), LOWEST_PORT + 1024)
        self._next = random.Random(seed).randrange(LOWEST_PORT, self._high)

    def ports(self, n: int) -> list[int]:
        """``n`` distinct ports, each free now (held together while chosen)."""
        with contextlib.ExitStack() as stack:
            chosen: list[int] = []
            for _ in range(self._high - LOWEST_PORT):
                if len(chosen) == n:
                    return chosen
                port = self._advance()
                s = stack.enter_context(socket.socket())
                if _binds(s, self.host, port):
                    chosen.append(port)
            raise RuntimeError(f"fewer than {n} free ports on {self.host} in [{LOWEST_PORT}, {self._high})")

    def port(self) -> int:
        return self.ports(1)[0]

    def run(self, count: int) -> int:
        """The first of ``count`` consecutive ports, all free now."""
        for _ in range(200):
            if self._next + count > self._high:
                self._next = LOWEST_PORT
            base = self._next
            self._next += count
            with contextlib.ExitStack() as stack:
                if all(_binds(stack.enter_context(socket.socket()), self.host, p) for p in range(base, base + count)):
                    return base
        raise RuntimeError(f"no run of {count} free ports on {self.host}")

    def _advance(self) -> int:
        port = self._next
        self._next = port + 1 if port + 1 < self._high else LOWEST_PORT
        return port


def _binds(s: socket.socket, host: str, port: int) -> bool:
    try:
        s.bind((host, port))
        return True
    except OSError:
        return False


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct free ports on ``host`` from a new picker (for a caller that picks once)."""
    return PortPicker(host).ports(n)
