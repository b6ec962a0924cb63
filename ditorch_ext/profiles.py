"""Chip profiles: what makes one process behave like chip A, B, C or D of the H2 paper.

A profile sets the emulated chip's memory capacity (enforced by the allocator), its speed
(every kernel is slowed so that wall time scales like the chip's throughput), its numerics
(matmul input rounding, denormal flushing) and its node shape (chips and NICs per node, used by
HeteroPP's planner and DiComm's topology).

Built-in profiles follow Table 5 of the H2 paper: FP16 throughput relative to an A100 (the
midpoint of the paper's range), memory per chip and chips per node. NICs per node and numerics
are not in the paper; they are chosen to be typical of such parts and documented per field.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Mapping

# The host runs kernels at the speed of a chip this many times an A100; a slower chip is made
# proportionally slower in wall time. 2.0 keeps every Table-5 chip (the fastest is 1.75) at or
# below the host so every profile can be emulated faithfully.
EMU_REFERENCE_SPEED = 2.0


@dataclasses.dataclass(frozen=True)
class ChipProfile:
    """One accelerator type. Memory in GiB before ``memory_scale``; speed relative to an A100."""

    name: str
    memory_gb: float
    relative_speed: float
    chips_per_node: int
    nics_per_node: int
    matmul_mantissa_bits: int = 23  # fp32 matmul inputs keep this many mantissa bits (23 = exact)
    flush_denormals: bool = False  # subnormal floats in op outputs become zero
    description: str = ""

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, expected: str) -> ValueError:
            return ValueError(f"chip profile {self.name!r}: {field}={value!r} is invalid; expected {expected}")

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"chip profile name must be a non-empty string, got {self.name!r}")
        if not _is_number(self.memory_gb) or self.memory_gb <= 0:
            raise bad("memory_gb", self.memory_gb, "a positive number of GiB")
        if not _is_number(self.relative_speed) or not 0 < self.relative_speed <= EMU_REFERENCE_SPEED:
            raise bad("relative_speed", self.relative_speed, f"a number in (0, {EMU_REFERENCE_SPEED}]")
        for field in ("chips_per_node", "nics_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(field, value, "a positive integer")
        if (
            not isinstance(self.matmul_mantissa_bits, int)
            or isinstance(self.matmul_mantissa_bits, bool)
            or not 1 <= self.matmul_mantissa_bits <= 23
        ):
            raise bad("matmul_mantissa_bits", self.matmul_mantissa_bits, "an integer in [1, 23]")
        if not isinstance(self.flush_denormals, bool):
            raise bad("flush_denormals", self.flush_denormals, "true or false")

    @property
    def slowdown(self) -> float:
        """Wall-time factor the emu vendor applies to each kernel."""
        return EMU_REFERENCE_SPEED / self.relative_speed

    def capacity_bytes(self, memory_scale: float = 1.0) -> int:
        return int(self.memory_gb * (1 << 30) * memory_scale)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


HOST = ChipProfile(
    "host", memory_gb=1024.0, relative_speed=EMU_REFERENCE_SPEED, chips_per_node=8, nics_per_node=8,
    description="no emulation: host speed, exact fp32, capacity bounded only by the host",
)

BUILTIN: dict[str, ChipProfile] = {
    p.name: p
    for p in (
        ChipProfile("A", 96, 0.75, 16, 8, matmul_mantissa_bits=16,
                    description="0.5-1.0x A100 FP16, 96 GB; matmul inputs keep 16 mantissa bits"),
        ChipProfile("B", 64, 0.75, 8, 8, matmul_mantissa_bits=14,
                    description="0.5-1.0x A100 FP16, 64 GB; matmul inputs keep 14 mantissa bits"),
        ChipProfile("C", 32, 0.25, 16, 4, matmul_mantissa_bits=12,
                    description="<0.5x A100 FP16, 32 GB; matmul inputs keep 12 mantissa bits"),
        ChipProfile("D", 32, 1.75, 8, 8, matmul_mantissa_bits=10, flush_denormals=True,
                    description="1.5-2.0x A100 FP16, 32 GB; TF32-like matmul (10 bits), denormals flushed"),
        HOST,
    )
}

_FIELDS = {f.name for f in dataclasses.fields(ChipProfile)}


def profile_from_dict(name: str, values: Mapping[str, Any], source: str = "profile") -> ChipProfile:
    """Validate a user-defined profile; unknown or missing fields are errors naming them."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{source}: chip {name!r} must be a mapping of fields, got {type(values).__name__}")
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise ValueError(f"{source}: chip {name!r} has unknown field(s) {unknown}; expected some of {sorted(_FIELDS - {'name'})}")
    required = {"memory_gb", "relative_speed", "chips_per_node", "nics_per_node"}
    missing = sorted(required - set(values))
    if missing:
        raise ValueError(f"{source}: chip {name!r} is missing field(s) {missing}")
    return ChipProfile(**{**values, "name": name})


def load_profile_file(path: str | os.PathLike) -> dict[str, ChipProfile]:
    """Read ``{chips: {NAME: {memory_gb: .., relative_speed: .., ...}}}`` from YAML or JSON."""
    import yaml

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    chips = data.get("chips") if isinstance(data, dict) else None
    if not isinstance(chips, dict) or not chips:
        raise ValueError(f"{path}: expected a top-level 'chips' mapping of chip name to profile fields")
    return {str(name): profile_from_dict(str(name), fields, source=str(path)) for name, fields in chips.items()}


def known_profiles() -> dict[str, ChipProfile]:
    """Built-in profiles plus those in ``$DITORCH_PROFILE_FILE`` (which may override them)."""
    profiles = dict(BUILTIN)
    if os.environ.get("DITORCH_PROFILE_FILE"):
        profiles.update(load_profile_file(os.environ["DITORCH_PROFILE_FILE"]))
    return profiles


def resolve(chip: str | ChipProfile) -> ChipProfile:
    """A profile by name (built-in or from the profile file), or a ChipProfile as is."""
    if isinstance(chip, ChipProfile):
        return chip
    profiles = known_profiles()
    if chip not in profiles:
        raise ValueError(f"unknown chip {chip!r}; known chips: {', '.join(sorted(profiles))}")
    return profiles[chip]


def memory_scale_from_env() -> float:
    raw = os.environ.get("DITORCH_MEMORY_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"DITORCH_MEMORY_SCALE={raw!r} is invalid; expected a positive number (e.g. 0.001)")
    return scale
