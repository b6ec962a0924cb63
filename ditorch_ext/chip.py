"""Which chip this process emulates: chosen by ``DITORCH_CHIP`` at import or ``set_chip()``."""
from __future__ import annotations

import os

from ditorch_ext import _C
from ditorch_ext.profiles import HOST, NUMERICS_FIELDS, ChipProfile, memory_scale_from_env, resolve, time_scale_or_default

_current: tuple[ChipProfile, float] = (HOST, 1.0)
_time_scale = 1.0


def set_chip(chip: str | ChipProfile, memory_scale: float | None = None, time_scale: float | None = None) -> ChipProfile:
    """Make this process behave as ``chip`` (a profile name or a ChipProfile).

    ``memory_scale`` multiplies the chip's memory (default: ``$DITORCH_MEMORY_SCALE`` or 1), so
    a 96 GB chip can be emulated as 96 MB with ``memory_scale=0.001``. ``time_scale`` (default:
    ``$DITORCH_TIME_SCALE`` or 1) makes the chip that many times slower than its profile, so that
    ranks outnumbering cores still run at their profiles' relative speeds; the host profile is
    never slowed.
    """
    global _current, _time_scale
    profile = resolve(chip)
    scale = memory_scale_from_env() if memory_scale is None else float(memory_scale)
    if not scale > 0:
        raise ValueError(f"memory_scale={memory_scale!r} is invalid; expected a positive number")
    stretch = time_scale_or_default(time_scale)
    capacity = 0 if profile is HOST else profile.capacity_bytes(scale)
    _C.set_chip_profile(
        name=profile.name, memory_bytes=capacity, slowdown=1.0 if profile is HOST else profile.slowdown * stretch,
        **{field: getattr(profile, field) for field in NUMERICS_FIELDS})
    _current, _time_scale = (profile, scale), stretch
    return profile


def current() -> tuple[ChipProfile, float]:
    """The active profile and memory scale."""
    return _current


def time_scale() -> float:
    """The time scale the active chip runs under."""
    return _time_scale


def configure_from_env() -> None:
    """Apply ``DITORCH_CHIP`` / ``DITORCH_MEMORY_SCALE`` / ``DITORCH_TIME_SCALE`` / ``DITORCH_EMU_UNSUPPORTED_OPS``."""
    set_chip(os.environ.get("DITORCH_CHIP") or "host")
    _C.set_unsupported_ops(os.environ.get("DITORCH_EMU_UNSUPPORTED_OPS", ""))
