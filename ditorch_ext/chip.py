"""Which chip this process emulates: chosen by ``DITORCH_CHIP`` at import or ``set_chip()``."""
from __future__ import annotations

import atexit
import dataclasses
import os
import sys

import torch

from ditorch_ext import _C
from ditorch_ext.profiles import HOST, NUMERICS_FIELDS, ChipProfile, memory_scale_from_env, resolve, time_scale_or_default

_current: tuple[ChipProfile, float] = (HOST, 1.0)
_time_scale = 1.0
_report_registered = False


def set_chip(chip: str | ChipProfile, memory_scale: float | None = None, time_scale: float | None = None) -> ChipProfile:
    """Make this process behave as ``chip`` (a profile name or a ChipProfile).

    ``memory_scale`` multiplies the chip's memory (default: ``$DITORCH_MEMORY_SCALE`` or 1), so
    a 96 GB chip can be emulated as 96 MB with ``memory_scale=0.001``. ``time_scale`` (default:
    ``$DITORCH_TIME_SCALE`` or 1) makes every kernel take that many times its datasheet time
    (docs/device.md, "Speed"), so that the host keeps up with the chips it emulates; the host
    profile is never slowed. With a time scale above 1 the process reports at exit how far its
    host fell behind the emulated device, if it did.
    """
    global _current, _time_scale, _report_registered
    profile = resolve(chip)
    scale = memory_scale_from_env() if memory_scale is None else float(memory_scale)
    if not scale > 0:
        raise ValueError(f"memory_scale={memory_scale!r} is invalid; expected a positive number")
    stretch = time_scale_or_default(time_scale)
    capacity = 0 if profile is HOST else profile.capacity_bytes(scale)
    sheet = profile.datasheet
    torch.ops.ditorch_emu.set_datasheet(list(sheet.peak_flops), sheet.memory_bytes_per_s, sheet.launch_s,
                                        sheet.fp32_matmul_as_tf32)
    _C.set_chip_profile(
        name=profile.name, memory_bytes=capacity, slowdown=0.0 if profile is HOST else stretch,
        **{field: getattr(profile, field) for field in NUMERICS_FIELDS})
    torch.ops.ditorch_emu.set_bf16_matmul_via_fp32(bf16_matmul_via_fp32())
    _current, _time_scale = (profile, scale), stretch
    if stretch > 1 and profile is not HOST and not _report_registered:
        atexit.register(_report_host_lateness)
        _report_registered = True
    return profile


BF16_VIA_FP32_ENV = "DITORCH_BF16_VIA_FP32"


def host_has_bf16_units() -> bool:
    """Whether this host's CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo):
    without them ATen's bf16 matmul is several times slower than fp32's (issue 54: 3.0x)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def bf16_matmul_via_fp32() -> bool:
    """Whether dipu's bf16 matmuls run as fp32 kernels with the result rounded to bf16
    (csrc/device/ChipNumerics.h): on hosts without bf16 units, or as ``$DITORCH_BF16_VIA_FP32``
    (1 or 0) says."""
    raw = os.environ.get(BF16_VIA_FP32_ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{BF16_VIA_FP32_ENV}={raw!r} is invalid; expected 1 (fp32 kernels, results rounded to "
                         f"bf16), 0 (ATen's bf16 kernels) or unset (decided by the host's CPU flags)")
    return raw == "1" if raw else not host_has_bf16_units()


def current() -> tuple[ChipProfile, float]:
    """The active profile and memory scale."""
    return _current


def time_scale() -> float:
    """The time scale the active chip runs under."""
    return _time_scale


@dataclasses.dataclass(frozen=True)
class EmulationStats:
    """What the emulated device's timeline saw (csrc/device/SpeedEmulation.h)."""

    kernels: int
    device_busy_s: float  # device time charged: the chip's roofline times the time scale
    host_late_s: float  # time the device sat idle waiting for the host's next kernel
    late_kernels: int

    @property
    def host_late_fraction(self) -> float:
        """Host lateness against device time: 0 when the host kept up with the chip."""
        return self.host_late_s / self.device_busy_s if self.device_busy_s > 0 else 0.0

    def describe(self) -> str:
        return (f"the host fell behind the emulated device by {self.host_late_s:.3f} s over {self.device_busy_s:.3f} s "
                f"of device time ({100 * self.host_late_fraction:.1f}%, {self.late_kernels} of {self.kernels} kernels "
                f"launched late)")


def emulation_stats(reset: bool = False) -> EmulationStats:
    """The device timeline's counters since the process started (or the last reset)."""
    kernels, busy, late, late_kernels = torch.ops.ditorch_emu.emulation_stats(reset)
    return EmulationStats(int(kernels), busy * 1e-9, late * 1e-9, int(late_kernels))


def timing_fence() -> None:
    """Synchronise the current dipu device as a bound of a timing sample. On an emulated chip the
    device's idle time around the fence (the host's work after its last launch and before its
    next) counts as host lateness (:func:`emulation_stats`), so a sample less its lateness is the
    chip's time from its first kernel to its last; elsewhere it is ``torch.dipu.synchronize()``."""
    torch.dipu.synchronize()
    torch.ops.ditorch_emu.fence_device_time()


# Lateness below this share of device time is noise (a sleep's overshoot, a preemption).
LATE_REPORT_FRACTION = 0.02
# "all": report the lateness at exit however small (make demo prints every rank's figure).
LATE_REPORT_ENV = "DITORCH_LATE_REPORT"


def _report_host_lateness() -> None:
    if _current[0] is HOST or _time_scale <= 1:
        return
    stats = emulation_stats()
    every = os.environ.get(LATE_REPORT_ENV, "") == "all"
    if stats.host_late_fraction > LATE_REPORT_FRACTION or (every and stats.device_busy_s > 0):
        rank = os.environ.get("RANK")
        print(f"ditorch: {'' if rank is None else f'rank {rank} '}chip {_current[0].name} at time scale "
              f"{_time_scale:g}: {stats.describe()}"
              + ("; this process ran slower than its chip, a larger time scale lets the host keep up"
                 if stats.host_late_fraction > LATE_REPORT_FRACTION else ""), file=sys.stderr)


def configure_from_env() -> None:
    """Apply ``DITORCH_CHIP`` / ``DITORCH_MEMORY_SCALE`` / ``DITORCH_TIME_SCALE`` / ``DITORCH_EMU_UNSUPPORTED_OPS``."""
    set_chip(os.environ.get("DITORCH_CHIP") or "host")
    _C.set_unsupported_ops(os.environ.get("DITORCH_EMU_UNSUPPORTED_OPS", ""))
