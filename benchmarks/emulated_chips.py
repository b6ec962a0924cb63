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


def speed_only_profiles(path: Path, chips: list[str]) -> dict[str, str]:
    """Write a ``DITORCH_PROFILE_FILE`` at ``path`` whose chip ``X_ieee`` is built-in ``X`` with
    the host's numerics; returns each chip's emulated name."""
    entries = {f"{c}_ieee": {f: getattr(BUILTIN[c], f) for f in SPEED_FIELDS} for c in chips}
    path.write_text("# built-in chips' speed, memory and node shape with the host's numerics "
                    "(benchmarks/emulated_chips.py)\n" + yaml.safe_dump({PROFILE_FILE_KEY: entries}, sort_keys=False))
    return {c: f"{c}_ieee" for c in chips}
