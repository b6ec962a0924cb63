"""The emulation's time scale: every emulated chip runs k times slower than its datasheet (the
host profile is not emulated), the default is chosen so the host keeps up, and the host's own
work between kernels is charged against the device's time instead of being added to it."""
from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ditorch
from ditorch_ext import _C
from ditorch_ext.profiles import ChipProfile, check_time_scale, time_scale_for

@pytest.fixture(autouse=True)
def _host_again():
    yield
    ditorch.set_chip("host", time_scale=1)


@settings(max_examples=60, deadline=None)
@given(speed=st.floats(1e-3, 4.0), scale=st.floats(1.0, 1e3))
def test_an_emulated_chip_runs_at_its_datasheet_times_the_time_scale(speed, scale):
    ditorch.set_chip(ChipProfile("T", memory_gb=8, relative_speed=speed, chips_per_node=8, nics_per_node=8),
                     time_scale=scale)
    assert _C.chip_slowdown() == scale  # the C++ profile's slowdown is the time scale over the datasheet
    assert ditorch.time_scale() == scale


@pytest.mark.parametrize("scale", [1, 2.5, 64])
def test_the_host_profile_is_never_slowed(scale):
    ditorch.set_chip("host", time_scale=scale)
    assert _C.chip_slowdown() == 0.0  # not emulated


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
    assert _C.chip_slowdown() == 3.0


@pytest.mark.parametrize("ratios,cores,want", [
    ([1.0] * 4, 2, 3.0), ([1.0] * 6, 2, 4.5), ([1.0] * 3, 2, 2.3), ([1.0], 2, 1.5), ([1.0] * 2, 8, 1.5),
    ([45.0] * 4, 2, 140.0),    # 45 x 1.5 x 2 = 135, up to two significant digits
    ([57.3] * 2, 2, 86.0),     # 85.95
    ([120.0] * 16, 2, 1500.0),  # 1440
    ([26.3, 117.3, 45.5, 45.5], 2, 180.0),  # the sum per core (117.3) ties the largest: 175.95
    ([117.0, 10.0, 10.0, 10.0], 2, 180.0),  # the largest rules: 117 x 1.5 = 175.5
    ([50.0, 50.0, 50.0, 10.0], 2, 120.0),   # the sum rules: 160 / 2 x 1.5
])
def test_the_default_time_scale_keeps_each_rank_and_all_ranks_on_the_cores_with_headroom(ratios, cores, want):
    assert time_scale_for(ratios, cores) == want


@pytest.mark.parametrize("bad,match", [([4.0, 0], "host_ratio=0 is invalid"), ([], r"host_ratios=\[\] is invalid"),
                                       ([float("nan")], "host_ratio=nan is invalid")])
def test_a_bad_host_ratio_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        time_scale_for(bad, 2)


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
    # Added, the device's 2 ms per item would take 40 ms more than the same items with no device
    # time, measured beside them: a loaded host oversleeps, and would by itself pass a fixed bound.
    alone = _items(20, 0.0, 0.008)
    elapsed = _items(20, 0.002, 0.008)
    assert 0.160 <= elapsed < alone + 0.015, (elapsed, alone)


def test_a_surplus_of_device_time_carries_a_later_host_bound_stretch():
    """As a forward pass queues more device time than its host work and the backward spends it
    (matmuls whose numerics the host computes at launch): the host runs ahead through the first
    stretch, so the second costs nothing extra and no launch finds the device idle."""
    from ditorch_ext.chip import emulation_stats

    torch.dipu.synchronize()
    emulation_stats(reset=True)
    start = time.perf_counter()
    # The surplus is 100 ms larger than the host work: a loaded host's oversleep (up to 5 ms per
    # 3 ms sleep) stays inside it. Were host and device time added, it would take 230 ms.
    for _ in range(40):
        _C.occupy_device(0.004)  # 160 ms of device time, launched at once
    for _ in range(20):
        time.sleep(0.003)  # 60 ms of host work ...
        _C.occupy_device(0.0005)  # ... launching 10 ms of device time
    torch.dipu.synchronize()
    elapsed = time.perf_counter() - start
    assert emulation_stats().late_kernels == 0
    assert 0.170 <= elapsed < 0.170 + 0.040, elapsed


def test_the_host_queues_a_launch_queue_of_kernels_then_waits_for_half_of_it():
    torch.dipu.synchronize()
    start = time.perf_counter()
    for _ in range(1000):
        _C.occupy_device(0.0005)  # 500 ms of device time
    queued = time.perf_counter() - start
    for _ in range(100):
        _C.occupy_device(0.0005)
    waited = time.perf_counter() - start
    torch.dipu.synchronize()
    assert queued < 0.150  # the launches alone: 1,000 kernels fit the queue
    # The 1,024th pending launch fills it: the host sleeps until the kernels ahead of the
    # newest 512 have run (about 256 ms of device time), then launches the rest.
    assert 0.240 <= waited < 0.240 + 0.150


@pytest.mark.parametrize("counted", [False, True], ids=["synchronize", "timing_fence"])
def test_a_timing_fence_counts_the_hosts_work_around_it_as_lateness_and_a_synchronisation_does_not(counted):
    """A timing sample's bounds: the host's work before its first launch and after its last
    kernel has run is idle device time, left out of the chip's time only at a timing fence."""
    from ditorch_ext.chip import emulation_stats, timing_fence

    bound = timing_fence if counted else torch.dipu.synchronize
    bound()
    before = emulation_stats().host_late_s
    time.sleep(0.020)  # the host's work before the first launch
    _C.occupy_device(0.005)
    time.sleep(0.030)  # and after the last kernel: the device idles the last 25 ms
    bound()
    late = emulation_stats().host_late_s - before
    if counted:
        assert 0.045 <= late < 0.045 + 0.040  # a loaded host oversleeps; it never undersleeps
    else:
        assert late < 0.002


def test_other_threads_run_while_the_host_waits_for_the_device():
    # torch.dipu.synchronize lets go of the GIL while it sleeps off the device's queue, as CUDA's
    # does: a pipeline stage's sender thread runs while the stage waits for its chip
    import threading

    ditorch.set_chip("A", time_scale=1)
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        _C.occupy_device(0.3)
        before = len(ticks)
        start = time.monotonic()
        torch.dipu.synchronize()
        waited, during = time.monotonic() - start, len(ticks) - before
    finally:
        stop.set()
        thread.join()
    assert waited >= 0.2  # the device's 0.3 s, less what passed before the wait
    assert during >= 10, f"the other thread ran {during} times in {waited:.3f} s of waiting"
