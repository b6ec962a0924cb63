"""Chip profiles: what makes one process behave like chip A, B, C or D of the H2 paper.

A profile sets the emulated chip's memory capacity (enforced by the allocator), its speed
(every kernel is slowed so that wall time scales like the chip's throughput; a job-wide *time
scale* slows every chip alike so that ranks sharing cores keep their profiles' speed), its numerics
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
    # Numerics (defaults: the host's IEEE arithmetic; see docs/device.md for each built-in's choice).
    matmul_mantissa_bits: int = 23  # fp32 matmul inputs keep this many mantissa bits (23 = exact)
    accumulator_bits: int = 23  # mantissa bits the matmul accumulator keeps between K-blocks (23 = fp32)
    accumulation_block: int = 0  # K-terms summed in fp32 before each accumulator rounding (0 = all of K)
    round_toward_zero: bool = False  # matmul/cast/special-function results narrowed to bf16/fp16 are truncated
    special_function_bits: int = 23  # mantissa bits of exp, softmax, rsqrt, silu, ... results
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
        for field in ("matmul_mantissa_bits", "accumulator_bits", "special_function_bits"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 23:
                raise bad(field, value, "an integer in [1, 23]")
        if not isinstance(self.accumulation_block, int) or isinstance(self.accumulation_block, bool) \
                or self.accumulation_block < 0:
            raise bad("accumulation_block", self.accumulation_block, "an integer >= 0 (0: the whole K)")
        for field in ("round_toward_zero", "flush_denormals"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, getattr(self, field), "true or false")

    @property
    def slowdown(self) -> float:
        """Wall-time factor the emu vendor applies to each kernel."""
        return EMU_REFERENCE_SPEED / self.relative_speed

    def capacity_bytes(self, memory_scale: float = 1.0) -> int:
        return int(self.memory_gb * (1 << 30) * memory_scale)


# The fields that make up a chip's numerics, in the order the runtime takes them.
NUMERICS_FIELDS = ("matmul_mantissa_bits", "accumulator_bits", "accumulation_block", "round_toward_zero",
                   "special_function_bits", "flush_denormals")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


HOST = ChipProfile(
    "host", memory_gb=1024.0, relative_speed=EMU_REFERENCE_SPEED, chips_per_node=8, nics_per_node=8,
    description="no emulation: host speed, exact fp32, capacity bounded only by the host",
)

# The reference of Table 1: the paper's A100, training with the same bf16 recipe. Its arithmetic
# is the host's (fp32 accumulation, round-to-nearest-even, IEEE special functions); only speed,
# memory and node shape are its own.
A100 = ChipProfile(
    "A100", memory_gb=80.0, relative_speed=1.0, chips_per_node=8, nics_per_node=8,
    description="the reference accelerator: A100 80 GB; IEEE arithmetic, fp32 accumulation, nearest-even",
)

BUILTIN: dict[str, ChipProfile] = {
    p.name: p
    for p in (
        # Numerics: see docs/device.md. Each chip's errors are systematic (truncating), graded A < B < C < D
        # as the paper's Table 1 MREs are; under bf16 autocast only the accumulator, the narrowing
        # and the special functions act (matmul inputs are already bf16).
        ChipProfile("A", 96, 0.75, 16, 8, matmul_mantissa_bits=16, special_function_bits=10,
                    description="0.5-1.0x A100 FP16, 96 GB per chip, 16 chips per node"),
        ChipProfile("B", 64, 0.75, 8, 8, matmul_mantissa_bits=14, accumulator_bits=12, accumulation_block=32,
                    special_function_bits=8, description="0.5-1.0x A100 FP16, 64 GB per chip, 8 chips per node"),
        ChipProfile("C", 32, 0.25, 16, 4, matmul_mantissa_bits=12, accumulator_bits=10, accumulation_block=16,
                    special_function_bits=7, description="<0.5x A100 FP16, 32 GB per chip, 16 chips per node"),
        ChipProfile("D", 32, 1.75, 8, 8, matmul_mantissa_bits=10, accumulator_bits=8, accumulation_block=8,
                    round_toward_zero=True, special_function_bits=6, flush_denormals=True,
                    description="1.5-2.0x A100 FP16, 32 GB per chip, 8 chips per node"),
        A100,
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


# The top-level key of an emulated chip profile file. It is not the planner's ``chips:`` (chip
# types with counts, TFLOPS and bandwidths, ``heteropp.ClusterSpec``): one file cannot pass for
# the other, and each loader names the other's schema when given the wrong file.
PROFILE_FILE_KEY = "emulated_chips"


def load_profile_file(path: str | os.PathLike) -> dict[str, ChipProfile]:
    """Read ``{emulated_chips: {NAME: {memory_gb: .., relative_speed: .., ...}}}`` from YAML or JSON."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    chips = data.get(PROFILE_FILE_KEY) if isinstance(data, dict) else None
    if isinstance(data, dict) and chips is None and "chips" in data:
        raise ValueError(f"{path}: this is a planner chip library or cluster file (top-level 'chips', read by "
                         f"`ditorch plan`), not an emulated chip profile file; those hold a top-level "
                         f"'{PROFILE_FILE_KEY}' mapping (see docs/device.md)")
    if not isinstance(chips, dict) or not chips:
        raise ValueError(f"{path}: expected a top-level '{PROFILE_FILE_KEY}' mapping of chip name to profile fields")
    return {str(name): profile_from_dict(str(name), fields, source=str(path)) for name, fields in chips.items()}


def known_profiles() -> dict[str, ChipProfile]:
    """Built-in profiles plus those in ``$DITORCH_PROFILE_FILE`` (which may override them)."""
    profiles = dict(BUILTIN)
    path = os.environ.get("DITORCH_PROFILE_FILE")
    if path:
        try:
            profiles.update(load_profile_file(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"DITORCH_PROFILE_FILE={path} is not a usable chip profile file: {exc}") from exc
    return profiles


def resolve(chip: str | ChipProfile) -> ChipProfile:
    """A profile by name (built-in or from the profile file), or a ChipProfile as is."""
    if isinstance(chip, ChipProfile):
        return chip
    profiles = known_profiles()
    if chip not in profiles:
        raise ValueError(f"unknown chip {chip!r}; known chips: {', '.join(sorted(profiles))}")
    return profiles[chip]


TIME_SCALE_ENV = "DITORCH_TIME_SCALE"


def check_time_scale(value: Any, source: str = "time_scale") -> float:
    """A time scale is a finite number >= 1: every emulated chip runs that many times slower."""
    try:
        scale = float(value)
    except (TypeError, ValueError):
        scale = float("nan")
    if isinstance(value, bool) or not (math.isfinite(scale) and scale >= 1):
        raise ValueError(f"{source}={value!r} is invalid; expected a number >= 1 (every emulated chip runs that "
                         f"many times slower than its profile, so that ranks sharing cores keep their speed)")
    return scale


def time_scale_from_env() -> float | None:
    """``$DITORCH_TIME_SCALE``, or None when unset."""
    raw = os.environ.get(TIME_SCALE_ENV)
    return None if raw in (None, "") else check_time_scale(raw, TIME_SCALE_ENV)


def time_scale_or_default(value: Any, source: str = "time_scale") -> float:
    """``value`` checked, or when it is None ``$DITORCH_TIME_SCALE``, else 1."""
    return (time_scale_from_env() or 1.0) if value is None else check_time_scale(value, source)


# A rank's host work is more than its kernels' charged cost: Python, autograd, communication
# threads, and kernels slowed by neighbours. At k = ranks per core, a 6-rank pipeline on 2 cores
# kept the cores 90% busy and ran 8% behind its simulation; at 1.5x that, 1% (docs/device.md).
HOST_HEADROOM = 1.5


def time_scale_for(ranks_per_host: int, cores: int | None = None) -> float:
    """The time scale that keeps ``ranks_per_host`` emulated chips faithful on ``cores`` cores
    (default: this host's): 1 while every rank has a core, else ranks per core times
    ``HOST_HEADROOM``. A chip's host work then fits in its emulated time even when every rank
    computes at once."""
    cores = cores or os.cpu_count() or 1
    return 1.0 if ranks_per_host <= cores else HOST_HEADROOM * ranks_per_host / cores


def memory_scale_from_env() -> float:
    raw = os.environ.get("DITORCH_MEMORY_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"DITORCH_MEMORY_SCALE={raw!r} is invalid; expected a positive number (e.g. 0.001)")
    return scale
