"""Chip profiles: what makes one process behave like chip A, B, C or D of the H2 paper, or like a
real part of the catalog (diutil/datasheets/catalog.py). Pure data: no torch, no compiled code
(the device layer, ``ditorch_ext.chip``, applies a profile to the emulated device).

A profile is a datasheet: peak dense throughput per precision (fp32, tf32, bf16, fp16, fp8 where
the part has it), memory bandwidth and capacity, kernel launch latency, and the node around the
chip (chips and NICs per node, scale-up and NIC bandwidths). An emulated kernel takes the
roofline of its FLOPs and bytes on that datasheet (csrc/device/KernelCosts.h) times the job's
*time scale*, never the host's own time; the time scale slows every chip alike so that the host,
whose CPU is far slower than any accelerator, keeps up (``time_scale_for``). The profile also
sets the chip's memory capacity (enforced by the allocator) and its numerics (matmul input
rounding, accumulation, denormal flushing).

H2's chips A-D follow Table 5 of the paper: throughput relative to an A100 (the midpoint of the
paper's range), memory per chip and chips per node. Their datasheet is the A100's with every
rate scaled by that relative speed (launch latency divided by it), so their relative speeds
hold for every kernel. NICs per node and numerics are not in the paper; they are chosen to be
typical of such parts and documented per field.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

# A relative speed this high was "the host's own speed" when chips were the host's time scaled;
# kept as the speed of a chip fast enough that the host bounds it (examples/table1_mre.py runs
# its chips at host speed with it).
EMU_REFERENCE_SPEED = 2.0

# The A100 SXM4 80 GB datasheet (dense, no sparsity), the reference of Table 5's relative
# speeds: NVIDIA A100 Tensor Core GPU datasheet (docs/device.md, "Catalog").
A100_TFLOPS = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": 0.0}
A100_MEMORY_GBPS = 2039.0
# Kernel launch latency: not on any datasheet. A CUDA kernel launch costs the host ~4-5 us and a
# small kernel's end-to-end device time is of that order; one figure for every catalog part.
LAUNCH_US = 5.0

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclasses.dataclass(frozen=True)
class Datasheet:
    """What the emulated device's roofline reads (SI units)."""

    peak_flops: tuple[float, ...]  # per PRECISIONS; 0: no such unit
    memory_bytes_per_s: float
    launch_s: float
    fp32_matmul_as_tf32: bool

    def peak(self, precision: str) -> float:
        """The FLOP/s ``precision`` runs at (a missing unit falls back as KernelCosts.cpp does)."""
        chain = {"fp32": ("fp32",), "tf32": ("tf32", "fp32"), "bf16": ("bf16", "fp16", "fp32"),
                 "fp16": ("fp16", "bf16", "fp32"), "fp8": ("fp8", "fp16", "bf16")}[precision]
        for p in chain:
            value = self.peak_flops[PRECISIONS.index(p)]
            if value > 0:
                return value
        return self.peak_flops[0]


@dataclasses.dataclass(frozen=True)
class ChipProfile:
    """One accelerator type. Memory in GiB before ``memory_scale``.

    Speed: either ``relative_speed`` alone (H2's chips: the A100's datasheet scaled) or a
    datasheet (``fp32_tflops`` and ``memory_gbps`` at least; ``relative_speed`` then defaults to
    the bf16 peak against the A100's)."""

    name: str
    memory_gb: float
    relative_speed: float | None
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
    # Datasheet (dense peaks in TFLOP/s, 0 = no such unit; bandwidths in GB/s = 1e9 B/s).
    fp32_tflops: float | None = None
    tf32_tflops: float = 0.0
    bf16_tflops: float = 0.0
    fp16_tflops: float = 0.0
    fp8_tflops: float = 0.0
    memory_gbps: float | None = None
    launch_us: float | None = None  # default LAUNCH_US (divided by relative_speed for H2's chips)
    intra_node_gbps: float | None = None  # scale-up bandwidth per chip, one direction
    nic_gbps: float | None = None  # scale-out bandwidth per chip, one direction
    source: str = ""  # where the figures come from (a datasheet, or "measured on ... by ditorch profile")

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, expected: str) -> ValueError:
            return ValueError(f"chip profile {self.name!r}: {field}={value!r} is invalid; expected {expected}")

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"chip profile name must be a non-empty string, got {self.name!r}")
        if not _is_number(self.memory_gb) or self.memory_gb <= 0:
            raise bad("memory_gb", self.memory_gb, "a positive number of GiB")
        has_sheet = self.fp32_tflops is not None or self.memory_gbps is not None
        if has_sheet:
            for field in ("fp32_tflops", "memory_gbps"):
                value = getattr(self, field)
                if not _is_number(value) or value <= 0:
                    raise bad(field, value, "a positive number (a datasheet needs fp32_tflops and memory_gbps)")
            for p in PRECISIONS[1:]:
                value = getattr(self, f"{p}_tflops")
                if not _is_number(value) or value < 0:
                    raise bad(f"{p}_tflops", value, "a number >= 0 (0: the part has no such unit)")
            if self.relative_speed is None:
                object.__setattr__(self, "relative_speed", self.datasheet.peak("bf16") / 1e12 / A100_TFLOPS["bf16"])
        elif self.relative_speed is None:
            raise bad("relative_speed", None, "a positive number (times an A100), or a datasheet "
                      "(fp32_tflops, memory_gbps, ...)")
        if not _is_number(self.relative_speed) or self.relative_speed <= 0:
            raise bad("relative_speed", self.relative_speed, "a positive number (times an A100)")
        for field in ("launch_us", "intra_node_gbps", "nic_gbps"):
            value = getattr(self, field)
            if value is not None and (not _is_number(value) or value < 0 or (field != "launch_us" and value == 0)):
                raise bad(field, value, "a positive number" if field != "launch_us" else "a number >= 0")
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
    def has_datasheet(self) -> bool:
        """Whether the profile states its own figures (else they are the A100's times relative_speed)."""
        return self.fp32_tflops is not None

    @property
    def datasheet(self) -> Datasheet:
        """The figures the emulated device's roofline runs on."""
        if self.has_datasheet:
            tflops = [getattr(self, f"{p}_tflops") for p in PRECISIONS]
            bandwidth, launch = self.memory_gbps, LAUNCH_US if self.launch_us is None else self.launch_us
        else:
            tflops = [A100_TFLOPS[p] * self.relative_speed for p in PRECISIONS]
            bandwidth = A100_MEMORY_GBPS * self.relative_speed
            launch = (LAUNCH_US if self.launch_us is None else self.launch_us) / self.relative_speed
        # A part whose fp32 matmuls keep 10 mantissa bits runs them on its TF32 units; H2's chips
        # keep one speed relative to one another on every kernel, so theirs stay at the fp32 rate.
        return Datasheet(tuple(t * 1e12 for t in tflops), bandwidth * 1e9, launch * 1e-6,
                         fp32_matmul_as_tf32=self.has_datasheet and self.matmul_mantissa_bits <= 10)

    @property
    def slowdown(self) -> float:
        """How many times an A100's time this chip takes for the same kernel (1 / relative_speed)."""
        return 1.0 / self.relative_speed

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
        HOST,
    )
}

from diutil.datasheets.catalog import CATALOG  # noqa: E402  (the catalog's parts are ChipProfiles)

BUILTIN.update(CATALOG)
A100 = CATALOG["A100"]

_FIELDS = {f.name for f in dataclasses.fields(ChipProfile)}


def profile_from_dict(name: str, values: Mapping[str, Any], source: str = "profile") -> ChipProfile:
    """Validate a user-defined profile; unknown or missing fields are errors naming them."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{source}: chip {name!r} must be a mapping of fields, got {type(values).__name__}")
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise ValueError(f"{source}: chip {name!r} has unknown field(s) {unknown}; expected some of {sorted(_FIELDS - {'name'})}")
    required = {"memory_gb", "chips_per_node", "nics_per_node"}
    required |= {"fp32_tflops", "memory_gbps"} if "relative_speed" not in values else set()
    missing = sorted(required - set(values))
    if missing:
        speed = "" if "relative_speed" in values else " (a speed: relative_speed, or a datasheet: fp32_tflops and " \
                                                     "memory_gbps)"
        raise ValueError(f"{source}: chip {name!r} is missing field(s) {missing}{speed}")
    return ChipProfile(**{"relative_speed": None, **values, "name": name})


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
        parts = sorted(set(CATALOG) - {"A100"} & set(profiles))  # the A100 is listed with H2's chips, its reference
        others = sorted(set(profiles) - set(parts))
        raise ValueError(f"unknown chip {chip!r}; known chips: {', '.join(others)}; catalog parts: {', '.join(parts)}")
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


# A rank's host work is more than its kernels: Python, autograd, communication threads, and
# neighbours taking the core. A time scale this many times what one rank alone needs leaves room
# for them (docs/device.md, "Speed").
HOST_HEADROOM = 1.5


def time_scale_for(host_ratios: Sequence[float], cores: int | None = None) -> float:
    """The time scale that lets the emulated chips of one host's ranks, on ``cores`` cores
    (default: this host's), keep their datasheet speeds relative to one another.

    ``host_ratios`` has one entry per rank on the host: how many times longer the host takes for
    that rank's work than its chip does at time scale 1 (``heteropp.runtime.profiler.host_ratio``
    measures it per chip for a model; 1 means unknown). Two bounds, each times ``HOST_HEADROOM``:
    the largest ratio (a rank's host work fits in its own device time) and the ratios' sum over
    the cores (all ranks' host work fits in the cores when every rank computes at once). Ranks of
    one chip make the two ``ratio * max(1, ranks / cores)``; a fleet of mixed chips needs less than
    its slowest-to-emulate chip on every rank. Rounded up to two significant digits."""
    ratios = list(host_ratios)
    if not ratios:
        raise ValueError("host_ratios=[] is invalid; expected one ratio per rank on the host")
    for ratio in ratios:
        if not _is_number(ratio) or ratio <= 0:
            raise ValueError(f"host_ratio={ratio!r} is invalid; expected a positive number")
    cores = cores or os.cpu_count() or 1
    scale = max(1.0, HOST_HEADROOM * max(max(ratios), sum(ratios) / cores))
    digits = 10 ** (math.floor(math.log10(scale)) - 1)
    return float(math.ceil(round(scale / digits, 9)) * digits) if scale >= 10 else math.ceil(scale * 10 - 1e-9) / 10


def memory_scale_from_env() -> float:
    raw = os.environ.get("DITORCH_MEMORY_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"DITORCH_MEMORY_SCALE={raw!r} is invalid; expected a positive number (e.g. 0.001)")
    return scale
