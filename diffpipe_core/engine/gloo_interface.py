"""Which network interface gloo uses when workers on several machines meet at ``MASTER_ADDR``.

gloo listens on the address its machine's hostname resolves to, and tells its peers that address; where the
hostname resolves to loopback (Debian's ``127.0.1.1`` line in ``/etc/hosts``, a container's ``127.0.0.1``) the
workers of the other machines cannot reach it and the run hangs in its first collective. Unless
``GLOO_SOCKET_IFNAME`` is set, a worker started by an external launcher names the interface of its route to
``MASTER_ADDR`` (a master on this machine is reached through its own address's interface)."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import MutableMapping

IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def ipv4_address(interface: str) -> str | None:
    """The IPv4 address of network interface ``interface``; None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def route_interface(address: str) -> str | None:
    """The interface this machine reaches IPv4 ``address`` (or host name) through; None when that is loopback or
    cannot be told."""
    try:
        target = socket.getaddrinfo(address, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # UDP: sends nothing, only picks the route and its source address
            local = s.getsockname()[0]
    except OSError:
        return None
    if ipaddress.ip_address(local).is_loopback:
        return None
    return next((name for _, name in socket.if_nameindex() if ipv4_address(name) == local), None)


def choose_gloo_interface(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``env`` to the interface of the route to ``MASTER_ADDR`` when it is unset and
    that route leaves loopback; returns the name set, None when it left ``env`` alone."""
    if env.get(IFNAME_ENV) or not env.get("MASTER_ADDR"):
        return None
    name = route_interface(env["MASTER_ADDR"])
    if name is not None:
        env[IFNAME_ENV] = name
    return name
