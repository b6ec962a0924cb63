"""torch.compile (Inductor) on dipu: the C++ kernels Inductor writes for the CPU, on dipu memory;
compiled against eager and dipu against the CPU in the same run; on emu, a compiled graph's kernels
charged to the emulated chip for their own work."""
from __future__ import annotations

import pytest
import torch

import ditorch
from ditorch_ext import _C

from ditorch_ext.inductor import host_addressable  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.dipu.is_available() or not host_addressable(),
                                reason="Inductor's C++ kernels need dipu memory the host addresses")


def block(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A decoder-ish block: matmul (an extern kernel), RMS norm, SiLU gate (fused C++ kernels)."""
    h = x @ w
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    return torch.nn.functional.silu(h) * h + x


def pointwise_chain(x: torch.Tensor) -> torch.Tensor:
    """Eight elementwise ops: eight eager kernels, one fused compiled kernel."""
    for _ in range(4):
        x = torch.sin(x) * 1.5
    return x


def test_compiled_matches_eager_on_dipu_and_the_cpu():
    torch.manual_seed(0)
    x, w, g = torch.randn(16, 64), torch.randn(64, 64) / 8, torch.randn(64)
    torch._dynamo.reset()
    compiled = torch.compile(block)
    on_cpu = compiled(x, w, g)
    dx, dw, dg = x.to("dipu"), w.to("dipu"), g.to("dipu")
    on_dipu = compiled(dx, dw, dg)
    assert on_dipu.device.type == "dipu"
    eager_dipu = block(dx, dw, dg)
    torch.testing.assert_close(on_dipu.cpu(), eager_dipu.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on_dipu.cpu(), on_cpu, rtol=1e-5, atol=1e-5)


def test_the_generated_code_runs_kernels_through_the_chip(tmp_path):
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(8, 32, device="dipu")
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(pointwise_chain), x)
    code = "\n".join(codes)
    assert "dipu_run_kernel(cpp_fused_" in code  # every C++ kernel enters run_kernel
    assert "device='dipu'" in code  # buffers on dipu
    torch.testing.assert_close(out.cpu(), pointwise_chain(x.cpu()))


@pytest.mark.slow
def test_training_through_a_compiled_module_matches_eager():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to("dipu")
    twin = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to("dipu")
    twin.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(twin)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    x, y = torch.randn(16, 32, device="dipu"), torch.randn(16, 8, device="dipu")
    for _ in range(3):
        for m, opt in zip((model, compiled), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.synchronous_vendor
def test_on_emu_a_fused_kernel_is_charged_its_own_work():
    """The compiled chain is one fused kernel: the chip is busy for its roofline time (launch
    latency plus the bytes it reads and writes over the memory bandwidth, from chip A's datasheet
    by hand) times the time scale; eager, eight kernels are charged, each as much."""
    if ditorch.vendor_name() != "emu":
        pytest.skip("only the emu vendor emulates a chip's time")
    from ditorch_ext.profiles import resolve

    x = torch.randn(1 << 14, device="dipu")
    torch._dynamo.reset()
    compiled = torch.compile(pointwise_chain)
    compiled(x)  # compiles on the host chip
    scale = 3.0
    ditorch.set_chip("A", time_scale=scale)
    sheet = resolve("A").datasheet
    stats = torch.ops.ditorch_emu.emulation_stats

    def busy_ns(fn) -> tuple[int, int]:
        torch.dipu.synchronize()
        stats(True)
        fn(x)
        kernels, busy, *_ = stats(False)
        return kernels, busy

    kernels, busy = busy_ns(compiled)
    nbytes = 2 * x.numel() * 4  # reads x, writes the result
    expected_ns = (sheet.launch_s + nbytes / sheet.memory_bytes_per_s) * scale * 1e9
    assert kernels == 1
    assert busy == pytest.approx(expected_ns, rel=1e-3), (busy, expected_ns)
    eager_kernels, eager_busy = busy_ns(pointwise_chain)
    assert eager_kernels == 8
    assert eager_busy > 4 * busy, (eager_busy, busy)


def test_without_host_addressable_memory_inductor_refuses_with_a_clear_error(monkeypatch):
    import ditorch_ext.inductor as inductor

    monkeypatch.setattr(inductor, "host_addressable", lambda: False)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="needs device memory the host addresses"):
        torch.compile(pointwise_chain)(torch.randn(4, device="dipu"))


def test_a_profile_shows_the_fused_kernels_on_the_device_row(tmp_path):
    import json

    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(4096, device="dipu")
    torch._dynamo.reset()
    compiled = torch.compile(pointwise_chain)
    compiled(x)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        compiled(x)
        torch.dipu.synchronize()
    fused = [e for e in prof.key_averages() if e.key.startswith("cpp_fused_")]
    assert fused and all(e.device_time_total > 0 for e in fused), [(e.key, e.device_time_total) for e in fused]
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e["name"].startswith("cpp_fused_")]
    assert kernels and all(k["pid"] == 0 for k in kernels)  # on the device's row
