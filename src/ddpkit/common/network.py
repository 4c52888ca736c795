"""Addresses and interfaces: which of this machine's addresses another node reaches it by, and
on which interface. Used by the launcher (what node 0 publishes) and the doctor (what each node
would use). No torch, and nothing is sent on the network."""

from __future__ import annotations

import ipaddress
import os
import socket


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def address_toward(host: str) -> str:
    """This machine's address on the route to `host`: what that host reaches it by. Loopback
    when `host` is loopback (every node on this machine); the FQDN when the route is unknown."""
    if is_loopback(host):
        return host
    try:
        family, _, _, _, target = socket.getaddrinfo(host, 1, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # a UDP "connect" sends nothing: it only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return socket.getfqdn()


def interface_of(address: str) -> str:
    """The name of the interface that holds `address` ("?" when none here does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return str(name)
    return "?"


def infiniband_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """The InfiniBand devices this machine has (their names), for NCCL's transport advice."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []
