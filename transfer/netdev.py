"""Which network interface a configured host address lives on, for UCX.

UCX (under NIXL) opens a TCP listener on every network device it may use,
whatever address the server was told to bind: with ``host: 127.0.0.1`` a
server would still accept connections on the machine's external interfaces.
``UCX_NET_DEVICES`` limits UCX to the named devices, so a server pins it to
the interface that holds its configured address (``lo`` for a loopback
cluster); a wildcard host (``0.0.0.0``, ``::``) leaves UCX every device.
UCX reads its settings only from the environment, before the agent starts.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915
SIOCGIFFLAGS = 0x8913
IFF_LOOPBACK = 0x8


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            out = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on this interface
            return None
    return ipaddress.IPv4Address(out[20:24])


def _is_loopback_device(name: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            out = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return False
    return bool(struct.unpack("H", out[16:18])[0] & IFF_LOOPBACK)


def _ipv6_addresses() -> list[tuple[ipaddress.IPv6Address, str]]:
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return []
    return [(ipaddress.IPv6Address(int(f[0], 16)), f[5]) for f in (line.split() for line in lines) if len(f) >= 6]


def interface_of(host: str) -> str | None:
    """The interface that holds ``host`` (an address or a name this machine resolves); None for a
    wildcard address, meaning every interface. ValueError when no interface of this machine has it."""
    try:
        address = ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, ValueError) as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc}") from None
    if address.is_unspecified:
        return None
    names = [name for _, name in socket.if_nameindex()]
    if address.is_loopback:
        return next((n for n in names if _is_loopback_device(n)), "lo")
    if isinstance(address, ipaddress.IPv4Address):
        found = next((n for n in names if _ipv4_of(n) == address), None)
    else:
        found = next((n for a, n in _ipv6_addresses() if a == address), None)
    if found is None:
        raise ValueError(f"host {host!r} ({address}) is not an address of any network interface of this machine")
    return found


def confine_ucx_to(host: str) -> None:
    """Sets ``UCX_NET_DEVICES`` to the interface of ``host`` (see the module docstring); a value
    already in the environment is left alone (debugging), as is a wildcard host."""
    if "UCX_NET_DEVICES" in os.environ:
        return
    device = interface_of(host)
    if device is not None:
        os.environ["UCX_NET_DEVICES"] = device
