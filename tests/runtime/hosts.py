"""Two emulated hosts for tests: Linux network namespaces joined by a veth pair, each with an
address of its own (root only). Traffic stays inside the namespaces this helper makes."""
from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Iterator

SUBNET = "10.231.{}.{}"


def can_make_hosts() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "the ip tool cannot list network namespaces"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[list[tuple[str, str]]]:
    """Yields [(namespace, address), (namespace, address)]; removes both on exit."""
    tag = f"dt{os.getpid() % 100000}"
    subnet = os.getpid() % 200 + 20
    hosts = [(f"{tag}a", SUBNET.format(subnet, 1)), (f"{tag}b", SUBNET.format(subnet, 2))]
    try:
        for ns, _ in hosts:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"{tag}x", "netns", hosts[0][0], "type", "veth", "peer", "name", f"{tag}y",
            "netns", hosts[1][0])
        for (ns, addr), dev in zip(hosts, (f"{tag}x", f"{tag}y")):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield hosts
    finally:
        for ns, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_host(ns: str, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]
