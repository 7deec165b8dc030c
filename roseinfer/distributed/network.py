"""Which network interface of this host reaches host 0.

gloo picks the address its ranks listen on from the host name, which often resolves to a
loopback address (as in a container or a network namespace); the other hosts then cannot reach
it. Unless GLOO_SOCKET_IFNAME says otherwise, a worker on several hosts uses the interface its
route to host 0 leaves by.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

logger = logging.getLogger("roseinfer")

_SIOCGIFADDR = 0x8915


def local_address_towards(address: str) -> str:
    """This host's address on the route to `address` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def interface_with_address(local_address: str) -> str | None:
    """The name of the IPv4 interface holding `local_address`, if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(packed[20:24]) == local_address:
                return name
    return None


def choose_gloo_interface(master_addr: str) -> None:
    """Set GLOO_SOCKET_IFNAME to the interface towards host 0, unless it is set already."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        name = interface_with_address(local_address_towards(socket.gethostbyname(master_addr)))
    except OSError as exc:
        logger.warning("cannot tell which interface reaches %s (%s); set GLOO_SOCKET_IFNAME", master_addr, exc)
        return
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        logger.debug("gloo uses interface %s towards %s", name, master_addr)
