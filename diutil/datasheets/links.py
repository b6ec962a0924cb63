"""The links of a fleet: one model that the planner, the simulator and an emulated run share.

A link is alpha-beta: ``n`` bytes take ``latency + n / bandwidth`` seconds, times the job's time
scale in an emulated run (its chips run that many times slower than their datasheets, so its
links do too). Where two chips talk decides the link: on one node the scale-up fabric
(``intra_node``), on two nodes of one DC the node network (``inter_node``), across DCs the
inter-cluster link (``inter_cluster``); between nodes the bandwidth is also bounded by both
chips' NICs. A chip's place is its DC, its node and its NIC's bandwidth (``Place``).

Sharing is the fleet's: ``inter_cluster`` is one link per direction between two DCs, whatever
pairs cross it (the cross-DC link every DP replica's stage boundary takes), and concurrent
messages share it equally; ``inter_node`` is the sending chip's NIC; ``intra_node`` its
scale-up port. heteropp/simulator.py's processor-sharing links and dicomm's emulated links
(csrc/comm/transport/EmulatedLinks.h, docs/dicomm.md "Emulated links") both follow it;
``FleetLinks.env`` states it to dicomm.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

GB = 1e9
LINK_CLASSES = ("intra_node", "inter_node", "inter_cluster")
# What a link may be: from a modem's 1 kB/s to beyond any scale-up fabric (100 TB/s), and up to
# 10 s one way. dicomm refuses the same ranges (EmulatedLinks.cpp).
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e3, 1e14  # bytes/s
MAX_LATENCY = 10.0  # s


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_bandwidth(value: Any, where: str) -> float:
    """``value`` bytes/s if it is a bandwidth a link may have, else a ValueError naming it."""
    if value is None:
        raise ValueError(f"{where}: the link has no bandwidth; expected bytes/s in [{MIN_BANDWIDTH:g}, {MAX_BANDWIDTH:g}]")
    if not _number(value) or not MIN_BANDWIDTH <= value <= MAX_BANDWIDTH:
        raise ValueError(f"{where}: bandwidth {value!r} bytes/s is out of range; expected bytes/s in "
                         f"[{MIN_BANDWIDTH:g}, {MAX_BANDWIDTH:g}] ({MIN_BANDWIDTH / GB:g} to {MAX_BANDWIDTH / GB:g} GB/s)")
    return float(value)


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """An alpha-beta link: a message of n bytes takes ``latency + n / bandwidth`` seconds."""

    bandwidth: float  # bytes/s
    latency: float  # s

    def __post_init__(self) -> None:
        check_bandwidth(self.bandwidth, "link")
        if not _number(self.latency) or not 0 <= self.latency <= MAX_LATENCY:
            raise ValueError(f"link: latency {self.latency!r} s is out of range; expected seconds in [0, {MAX_LATENCY:g}]")

    def transfer_time(self, nbytes: float, time_scale: float = 1.0) -> float:
        """Seconds ``nbytes`` take, in the fleet's time (``time_scale`` 1) or an emulated run's."""
        return (self.latency + nbytes / self.bandwidth) * time_scale

    def scaled(self, time_scale: float) -> "LinkSpec":
        """This link as an emulated run at ``time_scale`` has it (host seconds)."""
        return LinkSpec(self.bandwidth / time_scale, self.latency * time_scale) if time_scale != 1 else self

    def bounded(self, *nic_bandwidths: float | None) -> "LinkSpec":
        """This link with its bandwidth bounded by the NICs at its ends (None: not stated)."""
        nics = [n for n in nic_bandwidths if n is not None]
        return dataclasses.replace(self, bandwidth=min([self.bandwidth, *nics])) if nics else self

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "LinkSpec":
        """``{bandwidth_gbps: .., latency_us: ..}`` (latency optional, 0)."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping with bandwidth_gbps and latency_us, got {d!r}")
        unknown = sorted(set(d) - {"bandwidth_gbps", "latency_us"})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of ['bandwidth_gbps', 'latency_us']")
        gbps, us = d.get("bandwidth_gbps"), d.get("latency_us", 0.0)
        if gbps is None:
            raise ValueError(f"{where}: the link has no bandwidth (bandwidth_gbps)")
        if not _number(gbps) or not MIN_BANDWIDTH <= gbps * GB <= MAX_BANDWIDTH:
            raise ValueError(f"{where}: bandwidth_gbps={gbps!r} is out of range; expected GB/s in "
                             f"[{MIN_BANDWIDTH / GB:g}, {MAX_BANDWIDTH / GB:g}]")
        if not _number(us) or not 0 <= us * 1e-6 <= MAX_LATENCY:
            raise ValueError(f"{where}: latency_us={us!r} is out of range; expected microseconds in "
                             f"[0, {MAX_LATENCY * 1e6:g}]")
        return cls(bandwidth=float(gbps) * GB, latency=float(us) * 1e-6)

    def to_dict(self) -> dict:
        return {"bandwidth_gbps": round(self.bandwidth / GB, 9), "latency_us": round(self.latency * 1e6, 9)}


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a chip sits in the fleet: its DC, its node, and its NIC's bandwidth (bytes/s; None:
    not stated)."""

    dc: str
    node: str
    nic_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for field in ("dc", "node"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value or any(c in value for c in "/,=:\n"):
                raise ValueError(f"place: {field} {value!r} is invalid; expected a non-empty name without / , = :")
        if self.nic_bandwidth is not None:
            check_bandwidth(self.nic_bandwidth, f"place {self.dc}/{self.node}: NIC")

    def encode(self) -> str:
        """``DC/NODE/NIC_GBPS`` (DICOMM_LINK_PLACE)."""
        return f"{self.dc}/{self.node}/{0 if self.nic_bandwidth is None else self.nic_bandwidth / GB!r}"


def link_class(a: Place, b: Place) -> str:
    """The class of link two places talk over."""
    if a.dc != b.dc:
        return "inter_cluster"
    return "intra_node" if a.node == b.node else "inter_node"


@dataclasses.dataclass(frozen=True)
class FleetLinks:
    """A fleet's link classes (some of ``LINK_CLASSES``) and the DCs it has (None: any)."""

    classes: Mapping[str, LinkSpec]
    dcs: frozenset[str] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.classes) - set(LINK_CLASSES))
        if unknown:
            raise ValueError(f"fleet links: unknown class(es) {unknown}; expected some of {list(LINK_CLASSES)}")
        for name, spec in self.classes.items():
            if not isinstance(spec, LinkSpec):
                raise ValueError(f"fleet links: {name} must be a LinkSpec, got {spec!r}")

    def check_place(self, place: Place, who: str = "rank") -> None:
        """Refuse a place in a DC the fleet lacks, naming it."""
        if self.dcs is not None and place.dc not in self.dcs:
            raise ValueError(f"{who} is placed in DC {place.dc!r}, which the cluster does not have; "
                             f"its DCs: {sorted(self.dcs)}")

    def between(self, a: Place, b: Place) -> LinkSpec | None:
        """The link from ``a`` to ``b`` in the fleet's time (between nodes bounded by both NICs);
        None for a class the fleet does not name (host speed in an emulated run)."""
        cls = link_class(a, b)
        spec = self.classes.get(cls)
        if spec is None or cls == "intra_node":
            return spec
        return spec.bounded(a.nic_bandwidth, b.nic_bandwidth)

    def env(self, place: Place, time_scale: float, state: str | None = None) -> dict[str, str]:
        """The environment that makes dicomm emulate these links for a rank at ``place``
        (DICOMM_LINKS, DICOMM_LINK_PLACE, DITORCH_TIME_SCALE; DICOMM_LINK_STATE when given)."""
        self.check_place(place)
        if not _number(time_scale) or time_scale < 1:
            raise ValueError(f"time_scale={time_scale!r} is invalid; expected a number >= 1")
        links = ",".join(f"{name}={spec.bandwidth / GB!r}:{spec.latency * 1e6!r}"
                         for name, spec in sorted(self.classes.items()))
        env = {"DICOMM_LINKS": links, "DICOMM_LINK_PLACE": place.encode(), "DITORCH_TIME_SCALE": repr(float(time_scale))}
        if state is not None:
            env["DICOMM_LINK_STATE"] = str(state)
        return env
