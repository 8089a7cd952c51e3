"""This host's network addresses, and which of them other hosts can reach.

Standard library only: interfaces from :func:`socket.if_nameindex`, each one's IPv4 address and
flags from the ``SIOCGIFADDR``/``SIOCGIFFLAGS`` ioctls (Linux; elsewhere the addresses the
hostname resolves to), and the source address the kernel would use toward a peer from a UDP
``connect`` (which sends nothing). IPv4 only: the interfaces gloo and NCCL bind by default.

The hostname is a poor guide: Debian and Ubuntu map it to 127.0.1.1 in ``/etc/hosts``, and many
cluster nodes do not resolve their own name at all, so nothing here relies on it alone.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "InterfaceAddress",
    "interface_addresses",
    "interface_of",
    "is_loopback",
    "matches_ifname",
    "publish_candidates",
    "resolve_ipv4",
    "route_source",
]

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
# Bridges that exist with the same address on many hosts (containers, VMs): a peer that connects
# there reaches its own host. NCCL skips them by default too; they are tried last here.
_LOCAL_BRIDGE_PREFIXES = ("docker", "virbr", "veth", "br-", "cni", "flannel", "lxc")


@dataclass(frozen=True)
class InterfaceAddress:
    """One interface that is up and has an IPv4 address.

    Attributes:
        name: interface name, e.g. ``eth0`` (what GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name).
        address: its IPv4 address, dotted.
    """

    name: str
    address: str

    @property
    def loopback(self) -> bool:
        """True for 127.0.0.0/8."""
        return is_loopback(self.address)


def is_loopback(address: str) -> bool:
    """True when ``address`` (an IP address literal) is a loopback address; False otherwise."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _ioctl_ipv4(sock: socket.socket, name: str) -> str | None:
    import fcntl

    packed = struct.pack("256s", name.encode()[:15])
    try:
        flags = struct.unpack("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, packed)[16:18])[0]
        if not flags & _IFF_UP:
            return None
        return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)[20:24])
    except OSError:  # no IPv4 address on this interface
        return None


def interface_addresses() -> list[InterfaceAddress]:
    """Every interface of this host that is up and has an IPv4 address, in the kernel's order.

    On Linux each interface's primary IPv4 address (``ip addr``'s first); elsewhere the
    addresses the hostname resolves to, under the name ``"?"``.
    """
    if not sys.platform.startswith("linux"):
        return [InterfaceAddress("?", a) for a in resolve_ipv4(socket.gethostname())]
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            address = _ioctl_ipv4(sock, name)
            if address is not None:
                found.append(InterfaceAddress(name, address))
    return found


def resolve_ipv4(host: str) -> list[str]:
    """The IPv4 addresses ``host`` (a name or an address literal) resolves to; [] if none."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def route_source(peer: str) -> str | None:
    """The address of this host the kernel would send from to reach ``peer`` (an IPv4 address
    literal), or None when no route leads there. Sends no packet (a UDP ``connect``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer, 9))  # the discard port; any port gives the same route
            return str(sock.getsockname()[0])
        except OSError:
            return None


def matches_ifname(name: str, spec: str, *, nccl_style: bool) -> bool:
    """Whether interface ``name`` is selected by a GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME value.

    GLOO_SOCKET_IFNAME (``nccl_style=False``): comma-separated exact names. NCCL_SOCKET_IFNAME:
    comma-separated prefixes; a leading ``^`` makes the list one of exclusions, a leading ``=``
    (after any ``^``) asks for exact names (NCCL's own rules).
    """
    if not nccl_style:
        return name in {part.strip() for part in spec.split(",") if part.strip()}
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    parts = [part.strip() for part in body.split(",") if part.strip()]
    hit = any(name == part if exact else name.startswith(part) for part in parts)
    return hit != exclude


def publish_candidates(
    single_host: bool, env: Mapping[str, str], interfaces: Iterable[InterfaceAddress] | None = None
) -> tuple[list[str], str | None]:
    """The addresses a rank should publish for the others to connect to, best first.

    Args:
        single_host: every rank runs on this host (then only 127.0.0.1 is published).
        env: read for GLOO_SOCKET_IFNAME, else NCCL_SOCKET_IFNAME, which restrict the choice
            to the interfaces they name.
        interfaces: this host's interfaces (default :func:`interface_addresses`).

    Returns:
        ``(addresses, setting)``: the candidate addresses -- never a loopback one when the ranks
        span hosts -- and the variable that restricted them (None: none did). The address the
        hostname resolves to comes first when it is one of them; bridges that many hosts share
        (docker0, virbr0) come last. The list is empty when no interface qualifies.
    """
    if single_host:
        return ["127.0.0.1"], None
    ifaces = list(interface_addresses() if interfaces is None else interfaces)
    setting = None
    for var, nccl_style in (("GLOO_SOCKET_IFNAME", False), ("NCCL_SOCKET_IFNAME", True)):
        spec = env.get(var, "").strip()
        if spec:
            ifaces = [i for i in ifaces if matches_ifname(i.name, spec, nccl_style=nccl_style)]
            setting = var
            break
    usable = [i for i in ifaces if not i.loopback]
    named = set(resolve_ipv4(socket.gethostname()))
    usable.sort(key=lambda i: (i.name.startswith(_LOCAL_BRIDGE_PREFIXES), i.address not in named))
    return list(dict.fromkeys(i.address for i in usable)), setting


def interface_of(address: str, interfaces: Iterable[InterfaceAddress] | None = None) -> str | None:
    """The name of this host's interface that carries ``address``, or None."""
    for iface in interface_addresses() if interfaces is None else interfaces:
        if iface.address == address:
            return iface.name
    return None
