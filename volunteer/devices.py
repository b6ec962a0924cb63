"""The fleet an allocation is made for: reliable and unreliable devices and the links between them.

Delays are in seconds and bandwidths in bytes per second internally; ``devices.yaml`` gives
them in milliseconds and megabits per second, as a ping and a speed test report them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Device:
    """One device: its name, its compute (FLOP/s), its memory for model state (bytes; unbounded
    when not given) and, for a server, the address it serves on."""

    name: str
    flops: float
    address: str | None = None
    memory: float = float("inf")


@dataclasses.dataclass(frozen=True)
class Fleet:
    """Reliable devices S with their delay/bandwidth matrices (Ns x Ns), and unreliable devices U
    with theirs towards each reliable device (Nu x Ns): the paper's A_s, B_s, A_u, B_u."""

    reliable: tuple[Device, ...]
    unreliable: tuple[Device, ...]
    reliable_delay: np.ndarray
    reliable_bandwidth: np.ndarray
    unreliable_delay: np.ndarray
    unreliable_bandwidth: np.ndarray

    def __post_init__(self) -> None:
        ns, nu = len(self.reliable), len(self.unreliable)
        if ns < 2:
            raise ValueError(f"the fleet has {ns} reliable device(s); a stage needs a frontal and a backward server, so at least 2")
        names = [d.name for d in self.reliable + self.unreliable]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique; got {names}")
        for d in self.reliable + self.unreliable:
            if not d.flops > 0:
                raise ValueError(f"device {d.name!r}: compute {d.flops!r} FLOP/s must be positive")
        for what, m, shape in (("reliable_delay", self.reliable_delay, (ns, ns)),
                               ("reliable_bandwidth", self.reliable_bandwidth, (ns, ns)),
                               ("unreliable_delay", self.unreliable_delay, (nu, ns)),
                               ("unreliable_bandwidth", self.unreliable_bandwidth, (nu, ns))):
            if m.shape != shape:
                raise ValueError(f"{what} has shape {m.shape}; expected {shape}")
            if not np.all(np.isfinite(m)) or np.any(m < 0):
                raise ValueError(f"{what} must hold finite, non-negative values")
        off_diagonal = ~np.eye(ns, dtype=bool)
        if np.any(self.reliable_bandwidth[off_diagonal] <= 0) or np.any(self.unreliable_bandwidth <= 0):
            raise ValueError("every bandwidth between two distinct devices must be positive")

    @property
    def n_reliable(self) -> int:
        return len(self.reliable)

    @property
    def n_unreliable(self) -> int:
        return len(self.unreliable)

    @classmethod
    def from_dict(cls, spec: dict) -> "Fleet":
        """Build from the ``devices.yaml`` mapping (see docs/volunteer.md for the format)."""
        known = {"reliable", "unreliable", "reliable_delay_ms", "reliable_bandwidth_mbps",
                 "unreliable_delay_ms", "unreliable_bandwidth_mbps"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"devices: unknown key(s) {unknown}; expected some of {sorted(known)}")

        def devices(key: str) -> tuple[Device, ...]:
            out = []
            for i, d in enumerate(spec.get(key) or []):
                if not isinstance(d, dict) or "name" not in d or "tflops" not in d:
                    raise ValueError(f"devices: {key}[{i}] = {d!r}; expected a mapping with 'name' and 'tflops'")
                memory = float(d["memory_gb"]) * 2**30 if "memory_gb" in d else float("inf")
                out.append(Device(str(d["name"]), float(d["tflops"]) * 1e12, d.get("address"), memory))
            return tuple(out)

        reliable, unreliable = devices("reliable"), devices("unreliable")

        def matrix(key: str, rows: int, scale: float) -> np.ndarray:
            if rows == 0:
                return np.zeros((0, len(reliable)))
            if key not in spec:
                raise ValueError(f"devices: missing {key!r} ({rows} x {len(reliable)} matrix)")
            return np.asarray(spec[key], dtype=float) * scale

        return cls(reliable, unreliable,
                   matrix("reliable_delay_ms", len(reliable), 1e-3),
                   matrix("reliable_bandwidth_mbps", len(reliable), 1e6 / 8),
                   matrix("unreliable_delay_ms", len(unreliable), 1e-3),
                   matrix("unreliable_bandwidth_mbps", len(unreliable), 1e6 / 8))

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Fleet":
        import yaml

        with open(path) as f:
            spec = yaml.safe_load(f)
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: expected a mapping, got {type(spec).__name__}")
        return cls.from_dict(spec)

    def to_dict(self) -> dict:
        """The ``devices.yaml`` mapping this fleet was (or could have been) read from."""
        def dev(d: Device) -> dict:
            return {"name": d.name, "tflops": float(d.flops) / 1e12, **({"address": d.address} if d.address else {}),
                    **({"memory_gb": d.memory / 2**30} if d.memory != float("inf") else {})}
        return {
            "reliable": [dev(d) for d in self.reliable],
            "unreliable": [dev(d) for d in self.unreliable],
            "reliable_delay_ms": (self.reliable_delay * 1e3).tolist(),
            "reliable_bandwidth_mbps": (self.reliable_bandwidth * 8 / 1e6).tolist(),
            "unreliable_delay_ms": (self.unreliable_delay * 1e3).tolist(),
            "unreliable_bandwidth_mbps": (self.unreliable_bandwidth * 8 / 1e6).tolist(),
        }


def random_fleet(rng: np.random.Generator, n_reliable: int, n_unreliable: int, *,
                 delay_ms: tuple[float, float] = (10, 150), bandwidth_mbps: tuple[float, float] = (50, 3000),
                 tflops: tuple[float, float] = (10, 30), sites: int | None = None) -> Fleet:
    """A fleet drawn at random: devices spread over ``sites`` (default: a few), with short, fast
    links inside a site and the given ranges between sites, as HPC sites joined by the internet."""
    n = n_reliable + n_unreliable
    sites = sites or max(1, min(n_reliable, int(rng.integers(1, 5))))
    site = rng.integers(0, sites, size=n)
    site_delay = rng.uniform(*delay_ms, size=(sites, sites))
    site_delay = (site_delay + site_delay.T) / 2
    site_bw = rng.uniform(*bandwidth_mbps, size=(sites, sites))
    site_bw = (site_bw + site_bw.T) / 2
    delay = site_delay[site][:, site] * rng.uniform(0.9, 1.1, size=(n, n))
    bw = site_bw[site][:, site] * rng.uniform(0.9, 1.1, size=(n, n))
    same = site[:, None] == site[None, :]
    delay[same] = rng.uniform(0.05, 1.0, size=int(same.sum()))
    bw[same] = rng.uniform(5000, 20000, size=int(same.sum()))
    np.fill_diagonal(delay, 0.0)
    np.fill_diagonal(bw, 1e6)
    flops = rng.uniform(*tflops, size=n)
    r = slice(0, n_reliable)
    u = slice(n_reliable, n)
    return Fleet(
        tuple(Device(f"s{i}", float(flops[i]) * 1e12) for i in range(n_reliable)),
        tuple(Device(f"u{i}", float(flops[n_reliable + i]) * 1e12) for i in range(n_unreliable)),
        delay[r, r] * 1e-3, bw[r, r] * 1e6 / 8, delay[u, r] * 1e-3, bw[u, r] * 1e6 / 8)
