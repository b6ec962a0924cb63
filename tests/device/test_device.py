"""The dipu device against CPU results: factories, ops, views, memory, streams, RNG, errors."""
import gc
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import ditorch
import ditorch_ext


def test_ops_match_cpu_and_stay_on_dipu():
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    da, db = a.to("dipu"), b.to("dipu")
    for got, want in [
        (da + db, a + b),
        (da @ db.T, a @ b.T),
        (torch.softmax(da, -1), torch.softmax(a, -1)),
        (da.sum(0), a.sum(0)),
        (torch.cat([da, db]), torch.cat([a, b])),
        (da[db > 0], a[b > 0]),
        (torch.where(da > 0, da, db), torch.where(a > 0, a, b)),
    ]:
        assert got.device.type == "dipu"
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    assert ditorch.cpu_fallback_counts() == {}


def test_views_and_in_place_ops_share_storage():
    base = torch.zeros(4, 6, device="dipu")
    view = base.t()[1:3]  # native view ops
    view.add_(1)
    window = base.unfold(1, 2, 2)  # a view op served by the generic shim
    assert window.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    window.mul_(3)
    expected = torch.zeros(4, 6)
    expected.t()[1:3].add_(1)
    expected.unfold(1, 2, 2).mul_(3)
    torch.testing.assert_close(base.cpu(), expected)


def test_out_argument_is_resized_in_place():
    out = torch.empty(0, device="dipu")
    result = torch.add(torch.ones(3, 4, device="dipu"), 2, out=out)
    assert result is out and out.shape == (3, 4)
    torch.testing.assert_close(out.cpu(), torch.full((3, 4), 3.0))


def test_tensor_and_module_methods():
    x = torch.ones(2).dipu()
    assert x.is_dipu and x.device == torch.device("dipu", 0)
    m = torch.nn.Linear(2, 2).dipu()
    assert next(m.parameters()).is_dipu
    assert torch.accelerator.current_accelerator().type == "dipu"


@pytest.mark.two_devices
def test_multiple_devices_and_device_context():
    with torch.dipu.device(1):
        x = torch.ones(3, device="dipu")
        assert torch.dipu.current_device() == 1
    assert x.device.index == 1 and torch.dipu.current_device() == 0
    torch.testing.assert_close(x.to("dipu:0").cpu(), torch.ones(3))


def test_memory_stats_track_allocations():
    torch.dipu.empty_cache()
    before = torch.dipu.memory_allocated()
    torch.dipu.reset_peak_memory_stats()
    x = torch.empty(1 << 20, device="dipu")  # 4 MiB
    assert torch.dipu.memory_allocated() - before >= 4 << 20
    del x
    assert torch.dipu.memory_allocated() == before
    assert torch.dipu.max_memory_allocated() >= before + (4 << 20)
    if ditorch.vendor_name() == "emu":
        assert torch.dipu.memory_reserved() >= 4 << 20  # cached by ditorch
    else:
        assert torch.dipu.memory_reserved() == before  # returned to the native allocator, which caches
    torch.dipu.empty_cache()
    assert torch.dipu.memory_reserved() == torch.dipu.memory_allocated()


@pytest.mark.parametrize("op", ["add", "add_out", "resize_out"])
def test_a_kernel_result_is_adopted_not_copied(op):
    """A kernel allocates its result in device memory and the shim hands that block over as
    the dipu tensor: one allocation per result (a copy would take a second), and an out=
    argument the kernel grows takes the grown block itself."""
    a, b = torch.ones(1000, device="dipu"), torch.full((1000,), 2.0, device="dipu")
    out = torch.empty(0 if op == "resize_out" else 1000, device="dipu")
    before = torch.dipu.memory_stats()["allocation.all.allocated"]
    result = torch.add(a, b) if op == "add" else torch.add(a, b, out=out)
    after = torch.dipu.memory_stats()["allocation.all.allocated"]
    assert after - before == (0 if op == "add_out" else 1)
    assert result.device.type == "dipu"
    torch.testing.assert_close(result.cpu(), torch.full((1000,), 3.0))
    if op != "add":
        assert result.data_ptr() == out.data_ptr() and out.shape == (1000,)


def test_capacity_is_enforced_with_an_out_of_memory_error():
    # 32 GB x 1e-4 = 3.3 MiB free, beside what earlier tests of this process still hold on the
    # device (an xdist worker runs many; which ones depends on the schedule).
    gc.collect()
    scale = 1e-4 + torch.dipu.memory_reserved() / (32 * 2**30)
    ditorch.set_chip("C", memory_scale=scale)
    assert torch.dipu.get_device_properties().total_memory == int(32 * 2**30 * scale)
    small = torch.empty(1 << 18, device="dipu")  # 1 MiB fits
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 8\.00 MiB.*chip 'C'"):
        torch.empty(2 << 20, device="dipu")
    del small


@pytest.mark.synchronous_vendor
def test_slower_chip_is_slower_in_wall_time():
    """A slower chip's emulated time reaches the host's wall clock. Held against the emulated device
    clock of the same run, not against another wall-time measurement (on a loaded host the host
    chip's own wall time varies a hundredfold, so a wall-to-wall ratio says nothing): the same work
    is charged several times as much device time on chip C (0.25x an A100) as on chip D (1.75x),
    and every synchronised run on either chip takes at least the device time it was charged (the
    host slept it off; load on the host only adds wall time). The host chip is charged nothing."""
    from ditorch_ext.chip import emulation_stats

    a = torch.randn(128, 128, device="dipu")

    def run(chip: str) -> tuple[float, float]:
        ditorch.set_chip(chip, memory_scale=1.0)
        torch.dipu.synchronize()
        emulation_stats(reset=True)
        start = time.perf_counter()
        for _ in range(50):
            a @ a
        torch.dipu.synchronize()
        return time.perf_counter() - start, emulation_stats().device_busy_s

    assert run("host")[1] == 0.0
    busy = {"C": [], "D": []}
    for _ in range(2):
        for chip in ("D", "C"):
            wall, charged = run(chip)
            assert wall >= charged > 0, (chip, wall, charged)  # the device time was slept off, not dropped
            busy[chip].append(charged)
    assert min(busy["C"]) > 3 * max(busy["D"]), busy


def test_chip_numerics_round_matmul_inputs_and_flush_denormals():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    exact = a @ b
    torch.testing.assert_close((a.dipu() @ b.dipu()).cpu(), exact, rtol=0, atol=0)
    # Only fp32 input rounding to 10 mantissa bits, like TF32 (the built-in chips add more).
    ditorch.set_chip(ditorch.ChipProfile("TF32", 8, 2.0, 8, 8, matmul_mantissa_bits=10, flush_denormals=True))
    rounded = (a.dipu() @ b.dipu()).cpu()
    assert not torch.equal(rounded, exact)
    # Reference: round the inputs to 10 bits by hand, multiply in fp32.
    def round10(t):
        bits = t.view(torch.int32)
        return ((bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)  # nearest-even

    torch.testing.assert_close(rounded, round10(a) @ round10(b), rtol=1e-6, atol=1e-5)
    tiny = torch.tensor([1e-39, -2e-39, 1.0]).dipu()
    assert (tiny * 1.0).cpu().tolist() == [0.0, 0.0, 1.0]


def test_streams_and_events():
    s = torch.dipu.Stream()
    start, end = torch.dipu.Event(enable_timing=True), torch.dipu.Event(enable_timing=True)
    with torch.dipu.stream(s):
        assert torch.dipu.current_stream() == s
        start.record()
        x = torch.randn(256, 256, device="dipu")
        for _ in range(5):
            x = x @ x.T / 256
        end.record()
    assert torch.dipu.current_stream() != s
    torch.dipu.current_stream().wait_event(end)
    end.synchronize()
    assert end.query() and start.elapsed_time(end) > 0
    with pytest.raises((RuntimeError, ValueError), match="enable_timing"):
        e1, e2 = torch.dipu.Event(), torch.dipu.Event()
        e1.record(), e2.record()
        e1.elapsed_time(e2)
    torch.dipu.synchronize()


def test_random_ops_are_reproducible_and_independent_of_cpu():
    torch.manual_seed(7)
    a = torch.randn(100, device="dipu")
    torch.manual_seed(7)
    torch.randn(1000)  # CPU draws must not move the dipu generator
    b = torch.randn(100, device="dipu")
    assert torch.equal(a.cpu(), b.cpu())
    state = torch.dipu.get_rng_state()
    c = torch.rand(10, device="dipu")
    torch.dipu.set_rng_state(state)
    assert torch.equal(torch.rand(10, device="dipu").cpu(), c.cpu())
    g = torch.Generator(device="dipu").manual_seed(3)
    d = torch.randn(5, device="dipu", generator=g)
    g.manual_seed(3)
    assert torch.equal(torch.randn(5, device="dipu", generator=g).cpu(), d.cpu())
    drop = torch.nn.functional.dropout(torch.ones(1000, device="dipu"), 0.5)
    assert 300 < int((drop == 0).sum()) < 700


def test_save_and_load_round_trip(tmp_path):
    state = {"w": torch.randn(3, 4, device="dipu"), "b": torch.arange(5, device="dipu")}
    torch.save(state, tmp_path / "m.pt")
    on_dipu = torch.load(tmp_path / "m.pt", map_location="dipu")
    on_cpu = torch.load(tmp_path / "m.pt", map_location="cpu")
    for k in state:
        assert on_dipu[k].is_dipu and on_cpu[k].device.type == "cpu"
        assert torch.equal(on_dipu[k].cpu(), state[k].cpu()) and torch.equal(on_cpu[k], state[k].cpu())


def test_pinned_host_memory():
    x = torch.randn(1024).pin_memory()
    assert x.is_pinned()
    assert torch.equal(x.to("dipu", non_blocking=True).cpu(), x)


def test_unsupported_ops_fall_back_to_cpu_counted_and_warned_once():
    ditorch_ext.set_unsupported_ops(["aten::mm"])
    ditorch_ext.reset_cpu_fallback_counts()
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out = a.dipu() @ b.dipu()
    assert out.is_dipu
    torch.testing.assert_close(out.cpu(), a @ b)
    assert ditorch_ext.cpu_fallback_counts() == {"aten::mm": 3}
    assert sum("aten::mm is not supported" in str(w.message) for w in caught) == 1


def test_autocast_casts_like_cuda():
    a = torch.randn(8, 8, device="dipu")
    with torch.autocast("dipu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16  # lower-precision list
        assert torch.nn.functional.softmax(a @ a, -1).dtype == torch.float32  # fp32 list
    with torch.autocast("dipu", dtype=torch.float16):
        assert torch.nn.functional.linear(a, a).dtype == torch.float16


def test_bad_input_errors_name_the_value(tmp_path):
    with pytest.raises(RuntimeError, match="same device.*dipu:0.*cpu"):
        torch.ones(3, device="dipu") + torch.ones(3)
    with pytest.raises(ValueError, match="unknown chip 'Z'.*A, A100, B, C, D"):
        ditorch.set_chip("Z")
    with pytest.raises((IndexError, RuntimeError), match="dipu device index 99 is out of range"):
        torch.dipu.set_device(99)
    with pytest.raises(IndexError, match="dipu device index 42 is out of range"):
        torch.ones(1, device="dipu:42")
    bad = tmp_path / "chips.yaml"
    bad.write_text("emulated_chips:\n  X:\n    memory_gb: -4\n    relative_speed: 1\n    chips_per_node: 8\n    nics_per_node: 4\n")
    with pytest.raises(ValueError, match=r"chip profile 'X': memory_gb=-4 is invalid"):
        ditorch_ext.load_profile_file(bad)
    bad.write_text("emulated_chips:\n  X:\n    memory_gb: 4\n    speed: 1\n")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['speed'\]"):
        ditorch_ext.load_profile_file(bad)


def test_user_profile_file_and_environment_selection(tmp_path):
    path = tmp_path / "chips.yaml"
    path.write_text("emulated_chips:\n  E:\n    memory_gb: 8\n    relative_speed: 1.0\n    chips_per_node: 4\n"
                    "    nics_per_node: 2\n    matmul_mantissa_bits: 12\n")
    env = dict(os.environ, DITORCH_PROFILE_FILE=str(path), DITORCH_CHIP="E", DITORCH_MEMORY_SCALE="0.5")
    code = ("import torch, ditorch; p = torch.dipu.get_device_properties();"
            "print(p.chip, p.total_memory, p.chips_per_node, p.matmul_mantissa_bits)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["E", str(4 << 30), "4", "12"]
    env["DITORCH_CHIP"] = "nope"
    out = subprocess.run([sys.executable, "-c", "import ditorch"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "unknown chip 'nope'" in out.stderr


def test_a_planner_chip_library_is_refused_as_a_profile_file_and_the_reverse(tmp_path):
    """The two files' schemas differ; each loader names the other's when given the wrong one."""
    from heteropp import ClusterSpec

    library = Path(__file__).resolve().parents[2] / "examples" / "configs" / "chips-h2.yaml"
    with pytest.raises(ValueError, match="planner chip library or cluster file.*'emulated_chips'"):
        ditorch_ext.load_profile_file(library)
    env = dict(os.environ, DITORCH_PROFILE_FILE=str(library))
    out = subprocess.run([sys.executable, "-c", "import ditorch"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and f"DITORCH_PROFILE_FILE={library} is not a usable chip profile file" in out.stderr
    profiles = tmp_path / "emulated.yaml"
    profiles.write_text("emulated_chips:\n  E:\n    memory_gb: 8\n    relative_speed: 1.0\n    chips_per_node: 4\n"
                        "    nics_per_node: 2\n")
    with pytest.raises(ValueError, match="emulated chip profile file.*not a cluster or chip library"):
        ClusterSpec.from_yaml(profiles)


def test_backward_ops_with_their_own_autograd_run_the_vendor_kernel_as_on_cpu():
    """silu_backward has a kernel per device and, for devices without one, a decomposition into
    five ops; dipu runs the vendor's kernel (one op), so its backward runs the ops the CPU's does,
    with the CPU's gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(1000, dtype=torch.bfloat16)
    grads, ops = {}, {}
    for device in ("cpu", "dipu"):
        leaf = x.to(device, copy=True).requires_grad_()
        y = torch.nn.functional.silu(leaf)
        with Ops() as seen:
            y.backward(torch.ones_like(y))
        grads[device], ops[device] = leaf.grad.cpu(), seen.names
    assert "silu_backward" in ops["cpu"]
    assert ops["dipu"] == ops["cpu"], ops
    torch.testing.assert_close(grads["dipu"], grads["cpu"], rtol=0, atol=0)


@pytest.mark.synchronous_vendor
def test_backward_runs_on_the_thread_that_calls_it_as_on_cpu():
    """Kernels that run on the host gain nothing from autograd's device thread, so a dipu backward
    runs on the thread that called backward(), as a CPU one does: on the main thread and on a
    thread whose first dipu op is in its backward's graph. `set_multithreading_enabled(True)` gets
    the device thread back. The gradients are the CPU's either way."""
    import threading

    torch.manual_seed(0)
    w, x = torch.randn(16, 16), torch.randn(4, 16)

    def backward_thread(device: str, multithreading: bool | None) -> tuple[int, torch.Tensor]:
        leaf = w.to(device, copy=True).requires_grad_()
        hidden = torch.tanh(x.to(device) @ leaf)
        ran_on = []
        hidden.register_hook(lambda g: ran_on.append(threading.get_ident()))
        if multithreading is None:
            hidden.square().sum().backward()
        else:
            with torch.autograd.set_multithreading_enabled(multithreading):
                hidden.square().sum().backward()
        return ran_on[0], leaf.grad.cpu()

    want = backward_thread("cpu", None)[1]
    cases = [("main thread", None, True), ("main thread, multithreading on", True, False)]
    for name, multithreading, on_caller in cases:
        ran_on, grad = backward_thread("dipu", multithreading)
        assert (ran_on == threading.get_ident()) == on_caller, name
        torch.testing.assert_close(grad, want, rtol=0, atol=0)

    on_fresh_thread = {}

    def fresh():
        ran_on, grad = backward_thread("dipu", None)
        on_fresh_thread.update(caller=ran_on == threading.get_ident(), grad=grad)

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert on_fresh_thread["caller"], "a fresh thread's dipu backward ran on autograd's device thread"
    torch.testing.assert_close(on_fresh_thread["grad"], want, rtol=0, atol=0)
