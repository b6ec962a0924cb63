"""torch.profiler on dipu: kernels on the device's row of the trace, linked to the CPU ops that ran
them, with device time in key_averages(); on emu, the emulated chip's time."""
from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ditorch

DEVICE_ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


def _mm_profile(x: torch.Tensor, n: int = 8) -> profile:
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        for _ in range(n):
            x @ x
        torch.dipu.synchronize()
    return prof


def _least_kernel_us(prof: profile, time: str) -> float:
    """The least `time` ("cpu_time_total" or "device_time_total") of a profile's matmuls."""
    return min(getattr(e, time) for e in prof.events() if e.name == "aten::mm")


def _averages(prof: profile) -> dict:
    return {e.key: e for e in prof.key_averages()}


def test_a_dipu_matmul_has_device_time_and_a_cpu_matmul_has_none():
    x = torch.randn(128, 128, device="dipu")
    c = x.cpu()
    x @ x  # warm: the first run of a kernel is not what a profile measures
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        for _ in range(4):
            x @ x
        c @ c
        torch.dipu.synchronize()
    mm = [e for e in prof.events() if e.name == "aten::mm"]
    dipu_mm = [e for e in mm if e.device_time_total > 0]
    assert len(dipu_mm) == 4, f"4 dipu matmuls with device time expected, got {[e.device_time_total for e in mm]}"
    assert len(mm) == 5 and sum(1 for e in mm if e.device_time_total == 0) == 1  # the CPU one has none
    avg = _averages(prof)
    assert avg["aten::mm"].device_time_total > 0
    assert avg["aten::mm"].self_device_time_total == pytest.approx(avg["aten::mm"].device_time_total)
    # aten::matmul only dispatches: its device time is its child's, none of its own
    assert avg["aten::matmul"].device_time_total == pytest.approx(avg["aten::mm"].device_time_total)
    assert avg["aten::matmul"].self_device_time_total == 0


def test_a_cpu_only_profile_leaves_dipu_ops_without_device_time():
    x = torch.randn(64, 64, device="dipu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x @ x
    assert all(e.device_time_total == 0 for e in prof.key_averages())


def test_the_chrome_trace_has_the_kernels_on_the_device_row_linked_to_their_ops(tmp_path):
    x = torch.randn(96, 96, device="dipu")
    w = torch.randn(96, 96, device="dipu", requires_grad=True)
    with profile(activities=DEVICE_ACTIVITIES) as prof:
        (x @ w).relu().sum().backward()  # backward kernels run on autograd's device thread
        torch.dipu.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    cpu_ops = {e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    names = {k["name"] for k in kernels}
    assert {"aten::mm [dipu]", "aten::relu [dipu]"} <= names, names
    assert sum(1 for k in kernels if k["name"] == "aten::mm [dipu]") == 2  # the forward and w.grad (x needs none)
    for k in kernels:
        assert k["pid"] == 0 and k["args"]["device"] == 0  # the device's row, not the process's
        op = cpu_ops[k["args"]["External id"]]
        assert k["name"] == op["name"] + " [dipu]"
        # the kernel starts after its op does (the profiler's clock for CPU ops is a calibrated
        # cycle counter, the kernels' the system clock: they may differ by microseconds)
        assert k["ts"] >= op["ts"] - 20
    pids = {e["pid"] for e in events if e.get("cat") == "cpu_op"}
    assert 0 not in pids


@pytest.fixture
def one_host_thread():
    """ATen's kernels on one thread: a kernel split over two threads, on a host whose cores other
    processes hold, waits a whole scheduler slice (10 ms and more) for its descheduled half, so
    its host time is the scheduler's, not the kernel's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.synchronous_vendor
def test_on_emu_device_time_is_the_chips_emulated_time(one_host_thread):
    """The same matmuls on chip A at time scales s and 4s, in the same run: the device time scales
    by 4, as the chip's kernels do, while the host's work for them does not. s is raised until the
    chip's time is well above the host's for the kernel (below it the device waits for the host,
    and a trace shows the host's time, as a real device starved by its host does)."""
    if ditorch.vendor_name() != "emu":
        pytest.skip("only the emu vendor emulates a chip's time")
    x = torch.randn(128, 128, device="dipu")
    x @ x
    host_us = _least_kernel_us(_mm_profile(x), "cpu_time_total")  # the host chip: no emulation

    def device_us(scale: float) -> float:
        ditorch.set_chip("A", time_scale=scale)
        x @ x
        torch.dipu.synchronize()
        return _least_kernel_us(_mm_profile(x), "device_time_total")

    # 20x the host's time: the host's work per kernel may grow several-fold when other processes
    # load the cores, and must stay inside the chip's time for the trace to show the chip's
    scale = 1.0
    while device_us(scale) < 20 * host_us and scale < 4096:  # 4096: 29 ms per matmul on A
        scale *= 8
    # The least kernel of each: a kernel spans at least the chip's time, and a host descheduled
    # while the device is idle (at a profile's first kernel, say) can only add to it.
    slow, fast = min(device_us(4 * scale) for _ in range(2)), min(device_us(scale) for _ in range(2))
    assert slow / fast == pytest.approx(4.0, rel=0.15), (scale, fast, slow, host_us)
    assert fast > 4 * host_us  # the chip's time, not the host's


def test_the_legacy_fallback_times_dipu_ops_with_the_device_stubs():
    x = torch.randn(128, 128, device="dipu")
    x @ x
    with torch.autograd.profiler.profile(use_device="dipu", use_kineto=False) as prof:
        for _ in range(3):
            x @ x
    avg = {e.key: e for e in prof.key_averages()}
    assert avg["aten::mm"].device_time_total > 0


def test_profile_steps_parse_ranges_and_counts_and_refuse_the_rest():
    from ditorch_ext.profiler import parse_profile_steps

    assert parse_profile_steps("3-5") == (3, 5)
    assert parse_profile_steps("2") == (2, 3)  # after the first, warm-up step
    for bad in ("0", "5-3", "0-2", "a-b", "", "1-"):
        with pytest.raises(ValueError, match="profile-steps"):
            parse_profile_steps(bad)


def test_a_step_profiler_traces_only_its_steps(tmp_path):
    from ditorch_ext.profiler import StepProfiler

    x = torch.randn(64, 64, device="dipu")
    prof = StepProfiler(2, 3, tmp_path / "rank0.json")
    hook = prof.wrap(None)
    prof.before_run()
    for step in range(5):
        for _ in range(step + 1):  # step s (0-based) runs s + 1 matmuls
            x @ x
        assert hook(step) is False
    assert prof.written
    kernels = [e for e in json.loads((tmp_path / "rank0.json").read_text())["traceEvents"] if e.get("cat") == "kernel"]
    assert sum(1 for k in kernels if k["name"] == "aten::mm [dipu]") == 2 + 3  # steps 2 and 3 (1-based)
