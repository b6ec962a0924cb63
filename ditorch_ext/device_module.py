"""``torch.dipu``: the dipu device's module, in the shape of ``torch.cuda``."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import OrderedDict
from typing import Any, Iterator, Optional, Union

import torch

from ditorch_ext import _C, chip as _chip, profiles as _profiles, torch_compat as _torch_compat

_torch_compat.check_supported()

Device = Union[int, str, torch.device, None]
_PRIVATE_USE1 = 20  # c10::DeviceType::PrivateUse1, as torch.Stream wants it


def _index(device: Device = None) -> int:
    """Resolve a device argument to an index, with clear errors for the wrong device."""
    if device is None:
        return _C.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "dipu":
            raise ValueError(f"expected a dipu device, got {device}")
        return _C.current_device() if device.index is None else device.index
    if isinstance(device, int) and not isinstance(device, bool):
        if not 0 <= device < _C.device_count():
            raise IndexError(
                f"dipu device index {device} is out of range; this process has {_C.device_count()} dipu device(s)"
            )
        return device
    raise TypeError(f"expected a dipu device (int, str or torch.device), got {device!r}")


def is_available() -> bool:
    return _C.device_count() > 0


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    """Nothing to do: the runtime is ready once ``import ditorch`` returns."""


def device_count() -> int:
    return _C.device_count()


def current_device() -> int:
    return _C.current_device()


def set_device(device: Device) -> None:
    _C.set_device(_index(device))


def is_host_addressable() -> bool:
    """Whether a dipu tensor's ``data_ptr()`` is a host pointer (true for the emu vendor)."""
    return _C.host_addressable()


def is_asynchronous() -> bool:
    """Whether kernels run on the vendor's streams, asynchronously to the host (a native vendor
    over a device with a stream runtime, e.g. cuda); false where they run on the calling thread."""
    return _C.asynchronous()


@contextlib.contextmanager
def device(device: Device) -> Iterator[None]:
    """Make ``device`` current inside the block."""
    previous = _C.current_device()
    _C.set_device(_index(device))
    try:
        yield
    finally:
        _C.set_device(previous)


def synchronize(device: Device = None) -> None:
    """Wait for all work queued on ``device``."""
    _C.synchronize(_index(device))


def Stream(device: Device = None, priority: int = 0) -> torch.Stream:  # noqa: N802 (mirrors torch.cuda.Stream)
    """A new dipu stream. A plain ``torch.Stream``: PyTorch's stream APIs accept only that type."""
    return torch.Stream(device=torch.device("dipu", _index(device)), priority=priority)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:  # noqa: N802
    """A new dipu event. A plain ``torch.Event``: ``elapsed_time`` accepts only that type."""
    return torch.Event(device=torch.device("dipu", _C.current_device()), enable_timing=enable_timing,
                       blocking=blocking, interprocess=interprocess)


def current_stream(device: Device = None) -> torch.Stream:
    return torch.accelerator.current_stream(_index(device))


def default_stream(device: Device = None) -> torch.Stream:
    return torch.Stream(stream_id=0, device_index=_index(device), device_type=_PRIVATE_USE1)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: Optional[torch.Stream]) -> Iterator[None]:
    """Make ``stream`` current (on its device) inside the block; ``None`` is a no-op."""
    if stream is None:
        yield
        return
    previous = torch.accelerator.current_stream(stream.device_index)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)


# -- memory -------------------------------------------------------------------------------


def memory_stats_as_nested_dict(device: Device = None) -> dict[str, Any]:
    """The dipu allocator's statistics nested as ``torch.cuda.memory_stats_as_nested_dict`` nests
    them (the same ``c10::CachingDeviceAllocator::DeviceStats`` behind both)."""
    return _C.memory_stats(_index(device))


def memory_stats(device: Device = None) -> "OrderedDict[str, int]":
    """The dipu allocator's statistics, flat and sorted, under the names ``torch.cuda.memory_stats``
    uses (``"allocated_bytes.all.current"``, ``"segment.large_pool.peak"``, ...; the same as
    ``torch.accelerator.memory_stats()`` when dipu is the accelerator). See docs/device.md for
    what dipu's allocator counts."""
    flat: list[tuple[str, int]] = []

    def flatten(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat.append((prefix, value))

    flatten("", memory_stats_as_nested_dict(device))
    return OrderedDict(sorted(flat))


def memory_allocated(device: Device = None) -> int:
    return memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["current"]


def max_memory_allocated(device: Device = None) -> int:
    return memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"]


def memory_reserved(device: Device = None) -> int:
    return memory_stats_as_nested_dict(device)["reserved_bytes"]["all"]["current"]


def max_memory_reserved(device: Device = None) -> int:
    return memory_stats_as_nested_dict(device)["reserved_bytes"]["all"]["peak"]


def reset_peak_memory_stats(device: Device = None) -> None:
    _C.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: Device = None) -> None:
    _C.reset_accumulated_memory_stats(_index(device))


def empty_cache() -> None:
    """Return cached, unused device memory to the vendor."""
    _C.empty_cache()


def _format_bytes(n: int) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:6.0f} {unit}" if unit == "B  " else f"{n:6.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """A table of the allocator's statistics in the layout of ``torch.cuda.memory_summary``: for each
    metric its current value, peak, total allocated and total freed, over all blocks and (unless
    `abbreviated`) the large and small pools."""
    index = _index(device)
    stats = memory_stats_as_nested_dict(index)
    rows = [("allocated_bytes", "Allocated memory", True), ("active_bytes", "Active memory", True),
            ("requested_bytes", "Requested memory", True), ("reserved_bytes", "Device reserved memory", True),
            ("inactive_split_bytes", "Non-releasable memory", True), ("allocation", "Allocations", False),
            ("active", "Active allocs", False), ("segment", "Device reserved segments", False),
            ("inactive_split", "Non-releasable allocs", False)]
    pools = [("all", "")] if abbreviated else [("all", ""), ("large_pool", "      from large pool"),
                                                ("small_pool", "      from small pool")]
    width = 75
    lines = ["=" * width,
             f" dipu memory summary, device {index} ({get_device_name(index)})".ljust(width),
             "-" * width,
             f" {'Metric':<30}| {'Cur Usage':>10} | {'Peak Usage':>10} | {'Tot Alloc':>10} | {'Tot Freed':>10}",
             "-" * width]
    for key, label, in_bytes in rows:
        for pool, pool_label in pools:
            s = stats[key][pool]
            fmt = _format_bytes if in_bytes else (lambda n: f"{n:>10d}")
            values = " | ".join(f"{fmt(s[k]):>10}" for k in ("current", "peak", "allocated", "freed"))
            lines.append(f" {(pool_label or label):<30}| {values}")
        lines.append("-" * width)
    for key, label in (("num_alloc_retries", "Vendor allocation retries"), ("num_ooms", "Out-of-memory errors"),
                       ("num_device_alloc", "Vendor mallocs"), ("num_device_free", "Vendor frees")):
        lines.append(f" {label:<30}| {stats[key]:>10d}")
    lines.append("=" * width)
    return "\n".join(lines) + "\n"


def mem_get_info(device: Device = None) -> tuple[int, int]:
    """(free, total) bytes, as ``torch.accelerator.get_memory_info`` reports them: the chip profile's
    capacity (on a native vendor no more than the device's own) less what ditorch holds, and no
    more than the device has free; an unlimited chip (the host profile) has the host's memory on
    emu and the device's on a native vendor."""
    free, total = _C.mem_get_info(_index(device))
    return int(free), int(total)


# -- random numbers -------------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    _C.manual_seed(_C.current_device(), int(seed))


def manual_seed_all(seed: int) -> None:
    for d in range(_C.device_count()):
        _C.manual_seed(d, int(seed))


def seed() -> None:
    _C.seed(_C.current_device())


def seed_all() -> None:
    for d in range(_C.device_count()):
        _C.seed(d)


def initial_seed() -> int:
    return _C.initial_seed(_C.current_device())


def get_rng_state(device: Device = "dipu") -> torch.Tensor:
    return _C.get_rng_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device: Device = "dipu") -> None:
    _C.set_rng_state(_index(device), new_state.contiguous())


def get_rng_state_all() -> list[torch.Tensor]:
    return [_C.get_rng_state(d) for d in range(_C.device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for d, state in enumerate(new_states):
        set_rng_state(state, d)


# -- properties -----------------------------------------------------------------------------


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    name: str
    vendor: str
    chip: str
    total_memory: int
    relative_speed: float
    chips_per_node: int
    nics_per_node: int
    matmul_mantissa_bits: int
    accumulator_bits: int
    accumulation_block: int
    round_toward_zero: bool
    special_function_bits: int
    flush_denormals: bool


def _device_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes of the native vendor's device itself; (0, 0) on emu (the chip profile's
    capacity is all there is)."""
    kind = _C.kernel_device_type()
    if _C.vendor_name() == "emu":
        return 0, 0
    if kind == "cpu":
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")
    mem_get_info = getattr(getattr(torch, kind, None), "mem_get_info", None)
    return tuple(mem_get_info(index)) if callable(mem_get_info) else (0, 0)


def _native_device_name(index: int) -> str:
    """The kernel device's own name where its torch module gives one (torch.cuda and the like)."""
    module = getattr(torch, _C.kernel_device_type(), None)
    get_name = getattr(module, "get_device_name", None)
    return get_name(index) if callable(get_name) else _C.kernel_device_type()


def get_device_properties(device: Device = None) -> DeviceProperties:
    """The device as ditorch runs it: the chip profile (emulated, or the limits it sets on a native
    vendor's device: its memory capacity) over the vendor's device."""
    index = _index(device)
    profile, scale = _chip.current()
    capacity = profile.capacity_bytes(scale)
    _, device_total = _device_memory(index)
    vendor = _C.vendor_name()
    name = f"{vendor} chip {profile.name}" if vendor == "emu" else f"{_native_device_name(index)} as chip {profile.name}"
    return DeviceProperties(
        name=name,
        vendor=vendor,
        chip=profile.name,
        total_memory=min(capacity, device_total) if device_total else capacity,
        relative_speed=profile.relative_speed,
        chips_per_node=profile.chips_per_node,
        nics_per_node=profile.nics_per_node,
        **{field: getattr(profile, field) for field in _profiles.NUMERICS_FIELDS},
    )


def get_device_name(device: Device = None) -> str:
    return get_device_properties(device).name
