"""Emulated hosts for tests and benchmarks: each host is a Linux network namespace with a UTS
namespace of its own (its own hostname) and its own ``/etc/hosts`` (``ip netns exec`` mounts
``/etc/netns/<ns>/hosts`` over it), wired to the others through a bridge in a switch namespace.
Each host gets an IPv4 address, a unique-local IPv6 address and its link-local one; ``tc tbf``
can cap each host's link, both ways, to emulate slower inter-host links (``netem`` is not in this
kernel).

Needs root (CI runs as root); ``can_make_hosts()`` says why not otherwise, for ``skipif``. All
traffic stays inside the namespaces made here, and everything is removed on exit.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Sequence


_CLONE_NEWNET, _CLONE_NEWUTS, _CLONE_NEWNS = 0x40000000, 0x04000000, 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 1 << 18


@dataclasses.dataclass
class Host:
    name: str      # hostname inside the host, resolvable by every host
    ns: str        # network namespace
    dev: str       # its interface towards the switch
    address: str   # IPv4
    address6: str  # unique-local IPv6 (no duplicate address detection delay)

    def run(self, cmd: list[str]) -> list[str]:
        """`cmd` wrapped to run on this host (network, hostname and /etc/hosts of its own)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *cmd]

    def enter(self) -> None:
        """Move the calling process onto this host (before it starts threads or opens sockets):
        its network namespace, a UTS namespace with this host's name, and a mount namespace in
        which /etc/hosts is this host's. For spawned test ranks, which report through pipes."""
        libc = ctypes.CDLL(None, use_errno=True)

        def check(rc: int, what: str) -> None:
            if rc != 0:
                raise OSError(ctypes.get_errno(), f"{what} for emulated host {self.name}")

        fd = os.open(f"/var/run/netns/{self.ns}", os.O_RDONLY)
        try:
            check(libc.setns(fd, _CLONE_NEWNET), "setns(net)")
        finally:
            os.close(fd)
        check(libc.unshare(_CLONE_NEWUTS | _CLONE_NEWNS), "unshare(uts, mount)")
        socket.sethostname(self.name)
        check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount(private)")
        hosts = f"/etc/netns/{self.ns}/hosts".encode()
        check(libc.mount(hosts, b"/etc/hosts", None, _MS_BIND, None), "bind /etc/hosts")
        os.environ["GLOO_SOCKET_IFNAME"] = self.dev

    def link_local(self) -> str:
        """This host's IPv6 link-local address (without scope)."""
        out = subprocess.run(["ip", "-n", self.ns, "-6", "-o", "addr", "show", "dev", self.dev, "scope", "link"],
                             capture_output=True, text=True, check=True).stdout
        return out.split()[3].split("/")[0]

    def set_link(self, up: bool) -> None:
        """Take this host's only link down (it vanishes from the network) or back up."""
        _ip("-n", self.ns, "link", "set", self.dev, "up" if up else "down")


def can_make_hosts() -> str | None:
    """None when emulated hosts can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"emulated hosts need the {tool} tool"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "the ip tool cannot list network namespaces"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _sysctl(ns: str, *settings: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings], check=True, capture_output=True)


@contextlib.contextmanager
def emulated_hosts(count: int = 2, rate_mbit: float | Sequence[float | None] | None = None) -> Iterator[list[Host]]:
    """Yields `count` hosts on one switch. `rate_mbit` caps each host's link in both directions
    (tc tbf on the host's end and on the switch's end): one rate for every host, or one per host
    (None: unshaped)."""
    rates = list(rate_mbit) if isinstance(rate_mbit, Sequence) else [rate_mbit] * count
    if len(rates) != count:
        raise ValueError(f"{len(rates)} link rates for {count} hosts; give one per host or a single rate")
    tag = f"eh{os.getpid() % 100000}"
    subnet = os.getpid() % 200 + 20
    switch = f"{tag}s"
    hosts = [Host(name=f"{tag}-host{i}", ns=f"{tag}h{i}", dev=f"{tag}e{i}",
                  address=f"10.232.{subnet}.{i + 1}", address6=f"fd00:232:{subnet:x}::{i + 1}")
             for i in range(count)]
    made: list[str] = []
    netns_dirs: list[Path] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)
        for i, h in enumerate(hosts):
            _ip("netns", "add", h.ns)
            made.append(h.ns)
            # DAD would hold new IPv6 addresses back for a second or two.
            _sysctl(h.ns, "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("link", "add", h.dev, "netns", h.ns, "type", "veth", "peer", "name", f"{tag}p{i}", "netns", switch)
            _ip("-n", switch, "link", "set", f"{tag}p{i}", "master", "br0")
            _ip("-n", switch, "link", "set", f"{tag}p{i}", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.dev)
            _ip("-n", h.ns, "addr", "add", f"{h.address6}/64", "dev", h.dev, "nodad")
            _ip("-n", h.ns, "link", "set", h.dev, "up")
            if rates[i]:
                _shape(h.ns, h.dev, rates[i])               # host -> switch
                _shape(switch, f"{tag}p{i}", rates[i])      # switch -> host
            etc = Path("/etc/netns") / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            netns_dirs.append(etc)
        _wait_link_local(hosts)
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for etc in netns_dirs:
            shutil.rmtree(etc, ignore_errors=True)


def _shape(ns: str, dev: str, rate_mbit: float) -> None:
    """Token-bucket cap on `dev`'s egress. The bucket holds 4 ms at the rate (at least 16 KB,
    enough for the kernel's timer granularity) so a slow link cannot pass a large burst at once."""
    burst = max(16_000, int(rate_mbit * 1e6 / 8 * 0.004))
    subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                    "burst", str(burst), "latency", "100ms"], check=True, capture_output=True)


def _wait_link_local(hosts: list[Host], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    for h in hosts:
        while True:
            try:
                h.link_local()
                break
            except (IndexError, subprocess.CalledProcessError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{h.ns}: no IPv6 link-local address on {h.dev} after {timeout_s} s")
                time.sleep(0.05)
