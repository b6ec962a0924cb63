"""bf16 matmuls as fp32 kernels with the result rounded to bf16 (csrc/device/ChipNumerics.h), the
path a host without bf16 units takes: forced here by DITORCH_BF16_VIA_FP32=1 on a host that has
them, and checked against the CPU computing in fp32 and rounding once."""
from __future__ import annotations

import pytest
import torch

import ditorch
from ditorch_ext import chip as chip_module

CASES = {
    "mm": (torch.mm, [(48, 384), (384, 40)]),
    "addmm": (torch.addmm, [(48, 40), (48, 384), (384, 40)]),
    "bmm": (torch.bmm, [(3, 32, 256), (3, 256, 24)]),
    "baddbmm": (torch.baddbmm, [(3, 32, 24), (3, 32, 256), (3, 256, 24)]),
}


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(chip_module.BF16_VIA_FP32_ENV, "1")
    yield
    monkeypatch.delenv(chip_module.BF16_VIA_FP32_ENV)
    ditorch.set_chip("host")


@pytest.mark.parametrize("chip", ["host", "H100", "A"])  # unboxed shim (no numerics), and boxed (chip A's numerics)
@pytest.mark.parametrize("op", sorted(CASES))
def test_a_bf16_matmul_is_the_fp32_result_rounded_once(forced, chip, op):
    ditorch.set_chip(chip)
    assert torch.ops.ditorch_emu.bf16_matmul_via_fp32()
    fn, shapes = CASES[op]
    torch.manual_seed(0)
    args = [torch.randn(s).bfloat16() for s in shapes]
    got = fn(*[a.dipu() for a in args])
    assert got.dtype == torch.bfloat16 and got.device.type == "dipu"
    torch.testing.assert_close(got.cpu(), fn(*[a.float() for a in args]).bfloat16(), rtol=0, atol=0)


def test_the_fp32_kernel_is_what_runs(forced):
    # The widening of both inputs and the rounding of the result are ops of their own inside the
    # dipu mm (the profiler sees them); ATen's bf16 kernel makes none.
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(64, 128).bfloat16().dipu(), torch.randn(128, 32).bfloat16().dipu()

    def conversions() -> list:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            torch.mm(a, b)
        return sorted(tuple(e.input_shapes[0]) for e in prof.events() if e.name == "aten::_to_copy")

    ditorch.set_chip("H100")
    assert conversions() == [(64, 32), (64, 128), (128, 32)]
    torch.ops.ditorch_emu.set_bf16_matmul_via_fp32(False)
    assert conversions() == []


def test_fp32_and_mixed_matmuls_keep_their_kernels(forced):
    ditorch.set_chip("H100")
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    torch.testing.assert_close(torch.mm(a.dipu(), b.dipu()).cpu(), a @ b, rtol=0, atol=0)


def test_the_switch_follows_the_hosts_cpu_flags_unless_forced(monkeypatch):
    monkeypatch.delenv(chip_module.BF16_VIA_FP32_ENV, raising=False)
    monkeypatch.setattr(chip_module, "host_has_bf16_units", lambda: False)
    assert chip_module.bf16_matmul_via_fp32()
    monkeypatch.setattr(chip_module, "host_has_bf16_units", lambda: True)
    assert not chip_module.bf16_matmul_via_fp32()
    monkeypatch.setenv(chip_module.BF16_VIA_FP32_ENV, "1")
    assert chip_module.bf16_matmul_via_fp32()
    monkeypatch.setenv(chip_module.BF16_VIA_FP32_ENV, "yes")
    with pytest.raises(ValueError, match="DITORCH_BF16_VIA_FP32='yes' is invalid; expected 1"):
        chip_module.bf16_matmul_via_fp32()
