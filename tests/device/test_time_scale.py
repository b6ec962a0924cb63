"""The emulation's time scale: every emulated chip runs k times slower than its profile (the
host profile never), and the host's own work between kernels is charged against the device's
time instead of being added to it."""
from __future__ import annotations

import math
import statistics
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ditorch
from ditorch_ext import _C
from ditorch_ext.profiles import ChipProfile, check_time_scale, time_scale_for

# The emu vendor's host runs kernels as a chip twice an A100 would (docs/device.md): a chip of
# speed v (relative to an A100) is 2 / v times slower than the host, before the time scale.
HOST_SPEED = 2.0


@pytest.fixture(autouse=True)
def _host_again():
    yield
    ditorch.set_chip("host", time_scale=1)


@settings(max_examples=60, deadline=None)
@given(speed=st.floats(1e-3, HOST_SPEED), scale=st.floats(1.0, 1e3))
def test_an_emulated_chip_runs_time_scale_times_slower_than_its_profile(speed, scale):
    ditorch.set_chip(ChipProfile("T", memory_gb=8, relative_speed=speed, chips_per_node=8, nics_per_node=8),
                     time_scale=scale)
    assert _C.chip_slowdown() == pytest.approx(HOST_SPEED / speed * scale, rel=1e-12)
    assert ditorch.time_scale() == scale


@pytest.mark.parametrize("scale", [1, 2.5, 64])
def test_the_host_profile_is_never_slowed(scale):
    ditorch.set_chip("host", time_scale=scale)
    assert _C.chip_slowdown() == 1.0


@pytest.mark.parametrize("bad", [0.5, 0, -2, math.nan, math.inf, "fast", True, None])
def test_a_time_scale_below_one_or_not_a_number_is_refused(bad):
    with pytest.raises(ValueError, match=f"time_scale={bad!r} is invalid; expected a number >= 1"):
        check_time_scale(bad)


def test_a_bad_time_scale_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("DITORCH_TIME_SCALE", "0.5")
    with pytest.raises(ValueError, match="DITORCH_TIME_SCALE='0.5' is invalid"):
        ditorch.set_chip("A")
    monkeypatch.setenv("DITORCH_TIME_SCALE", "3")
    ditorch.set_chip("A")
    assert _C.chip_slowdown() == pytest.approx(HOST_SPEED / 0.75 * 3)


@pytest.mark.parametrize("ranks,cores,want", [(4, 2, 3.0), (6, 2, 4.5), (3, 2, 2.25), (1, 2, 1.0), (2, 2, 1.0),
                                               (2, 8, 1.0), (9, 8, 1.6875)])
def test_the_default_time_scale_is_one_while_ranks_have_cores_else_one_and_a_half_ranks_per_core(ranks, cores, want):
    assert time_scale_for(ranks, cores) == want


def _items(n: int, device_s: float, host_work_s: float) -> float:
    """n kernels of `device_s` device time each, with `host_work_s` of host work after each."""
    torch.dipu.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        _C.occupy_device(device_s)
        time.sleep(host_work_s)  # host work off the CPU, as while a neighbour holds the core
    torch.dipu.synchronize()
    return time.perf_counter() - start


def test_host_work_shorter_than_the_device_time_costs_nothing_extra():
    # Charged against the device's 10 ms, the 4 ms of host work after each kernel is hidden;
    # added, 20 items would take 280 ms.
    assert _items(20, 0.010, 0.004) < 0.200 + 0.040


def test_host_work_longer_than_the_device_time_is_what_the_step_takes():
    # A host-bound chip: the device idles between kernels, so the host's 8 ms per item is the time.
    elapsed = _items(20, 0.002, 0.008)
    assert 0.160 <= elapsed < 0.160 + 0.045


def _timed_kernel(a: torch.Tensor) -> float:
    torch.dipu.synchronize()
    start = time.perf_counter()
    a @ a
    torch.dipu.synchronize()
    return time.perf_counter() - start


@pytest.mark.synchronous_vendor
def test_a_kernel_is_charged_its_own_shapes_cost():
    # Kernels are charged the least host time of their op's recent runs on the same shapes (SpeedEmulation.h);
    # a 512x512 matmul after many 16x16 ones must still cost what 512x512 does, ~8000x the flops.
    ditorch.set_chip(ChipProfile("slow", memory_gb=8, relative_speed=0.2, chips_per_node=8, nics_per_node=8))
    small, big = torch.randn(16, 16, device="dipu"), torch.randn(512, 512, device="dipu")
    for _ in range(50):
        small @ small
    small_s = min(_timed_kernel(small) for _ in range(5))
    big_s = min(_timed_kernel(big) for _ in range(3))
    assert big_s > 20 * small_s, (small_s, big_s)
