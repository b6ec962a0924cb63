"""Emulated chips for the benchmark programs: the built-in profiles' speed, memory and node
shape with the host's IEEE numerics.

A chip's emulated numerics (bf16 accumulation in narrow blocks, docs/device.md) cost the host
20-60x the bf16 kernel they round, more than the slower chips' device time: with them, B, C and
D run at the speed of their numerics' emulation, not of their profile. Benchmarks of speed
(HeteroSpeedupRatio, the runtime against the simulator) therefore default to these.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from ditorch_ext.profiles import BUILTIN, PROFILE_FILE_KEY

SPEED_FIELDS = ("memory_gb", "relative_speed", "chips_per_node", "nics_per_node")


def speed_only_profiles(path: Path, chips: list[str], memory_gb: float | None = None) -> dict[str, str]:
    """Write a ``DITORCH_PROFILE_FILE`` at ``path`` whose chip ``X_ieee`` is built-in ``X`` with
    the host's numerics (and, if given, ``memory_gb`` GiB per chip instead of ``X``'s own);
    returns each chip's emulated name."""
    if memory_gb is not None and not memory_gb > 0:
        raise ValueError(f"memory_gb {memory_gb!r}: expected a positive number of GiB per chip")
    entries = {f"{c}_ieee": {f: getattr(BUILTIN[c], f) for f in SPEED_FIELDS} for c in chips}
    if memory_gb is not None:
        for entry in entries.values():
            entry["memory_gb"] = memory_gb
    what = "speed and node shape" + (f", {memory_gb:g} GiB each" if memory_gb is not None else " and memory")
    path.write_text(f"# built-in chips' {what}, with the host's numerics "
                    "(benchmarks/emulated_chips.py)\n" + yaml.safe_dump({PROFILE_FILE_KEY: entries}, sort_keys=False))
    return {c: f"{c}_ieee" for c in chips}
