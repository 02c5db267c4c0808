"""Transfer listeners bind the configured interface (DESIGN invariant 9): the TCP receiver binds its
host, and NIXL's UCX listens only on the interfaces holding the host's address."""

from __future__ import annotations

import os

import pytest
import torch

from glmserve.kv.transfer import make_backend, nixl_unavailable_reason
from glmserve.kv.transfer.net_devices import interface_addresses, interfaces_for
from tests.services.listening_sockets import listening_addresses, non_loopback

_nixl = nixl_unavailable_reason()
HAS_EXTERNAL = any(not a.startswith(("127.", "::1")) and not a.startswith("fe80")
                   for addrs in interface_addresses().values() for a in addrs)


def _new_listeners(kind: str, **options) -> set[tuple[str, int]]:
    """The sockets a receiver of ``kind`` opens once it hands out its target info."""
    before = listening_addresses(os.getpid())
    backend = make_backend(kind, **options)
    try:
        backend.register(torch.zeros(4, 4096, dtype=torch.uint8))
        backend.target_info()
        return listening_addresses(os.getpid()) - before
    finally:
        backend.close()


def test_loopback_maps_to_the_loopback_interface() -> None:
    names = interfaces_for("127.0.0.1")
    assert names and all("127.0.0.1" in interface_addresses()[n] for n in names)
    assert interfaces_for("0.0.0.0") is None and interfaces_for("::") is None
    with pytest.raises(ValueError, match="host"):
        interfaces_for("192.0.2.254" if "192.0.2.254" not in str(interface_addresses()) else "198.51.100.9")


def test_tcp_receiver_listens_on_loopback_only() -> None:
    opened = _new_listeners("tcp", host="127.0.0.1")
    assert opened and not non_loopback(opened)


@pytest.mark.skipif(_nixl is not None, reason=f"nixl does not import here: {_nixl}")
def test_nixl_receiver_listens_on_loopback_only() -> None:
    opened = _new_listeners("nixl", host="127.0.0.1")
    assert opened and not non_loopback(opened), opened
    assert "UCX_NET_DEVICES" not in os.environ  # restored: a second backend may want another host


@pytest.mark.skipif(_nixl is not None or not HAS_EXTERNAL, reason="needs nixl and a non-loopback interface")
def test_nixl_without_a_host_listens_beyond_loopback() -> None:
    """The control: what the host option prevents does happen without it on this machine."""
    assert non_loopback(_new_listeners("nixl"))
