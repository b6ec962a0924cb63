"""Which address a server tells its peers: the bound one, or a routable one for a wildcard bind."""
from __future__ import annotations

import ipaddress
import socket


def split(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (an IPv6 host may be bracketed); a bad one is named."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"address {address!r}; expected HOST:PORT")
    return host, int(port)


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def route_source(peer_host: str) -> str:
    """The local address of the interface that routes to ``peer_host`` (as gloo and NCCL pick it).

    A UDP ``connect`` only asks the kernel for the route: no packet is sent.
    """
    family = socket.AF_INET6 if _is_v6(peer_host) else socket.AF_INET
    infos = socket.getaddrinfo(peer_host, 9, family, socket.SOCK_DGRAM)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        return s.getsockname()[0]


def advertised(bind: str, advertise: str | None, toward: str | None) -> str:
    """What peers should dial for a server bound at ``bind``.

    ``advertise`` when given; else ``bind`` unless it is a wildcard; else the bound port on the
    address that routes to ``toward`` (the leader, for a follower); else the host name's address.
    """
    if advertise:
        split(advertise)
        return advertise
    host, port = split(bind)
    if not is_wildcard(host):
        return bind
    try:
        if toward:
            return join(route_source(split(toward)[0]), port)
        return join(socket.gethostbyname(socket.gethostname()), port)
    except OSError as exc:
        raise ValueError(f"bound to {bind!r} and cannot tell which address peers reach this host at ({exc}); "
                         "give --advertise HOST:PORT") from None


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).version == 6
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a server started next (another process may
    take it first: callers that can, retry on a failed bind)."""
    with socket.socket(socket.AF_INET6 if _is_v6(host) else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) stays on this machine: localhost, 127/8, ::1."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
