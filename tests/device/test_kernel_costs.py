"""An emulated kernel costs the roofline of its work on the chip's datasheet
(csrc/device/KernelCosts.h): launch latency + max(FLOPs / peak of its precision, bytes / memory
bandwidth), times the time scale; the host's own time never enters. Each case is computed by
hand here from the op's shapes (FLOPs as torch.utils.flop_counter counts them) and compared with
the device time the emulated timeline charged."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import ditorch
from ditorch_ext.chip import emulation_stats
from ditorch_ext.profiles import ChipProfile

# the device time is charged where kernels run on the calling thread (tests/device/conftest.py)
pytestmark = pytest.mark.synchronous_vendor

TFLOPS = {"fp32": 2.0, "bf16": 8.0}  # a small made-up part, so that times are milliseconds
GBPS = 50.0
LAUNCH_US = 3.0


def _chip(**overrides) -> ChipProfile:
    fields = dict(fp32_tflops=TFLOPS["fp32"], bf16_tflops=TFLOPS["bf16"], memory_gbps=GBPS, launch_us=LAUNCH_US)
    return ChipProfile("sheet", 8, None, 8, 8, **{**fields, **overrides})


def _roofline(flops: float, nbytes: float, tflops: float) -> float:
    return LAUNCH_US * 1e-6 + max(flops / (tflops * 1e12), nbytes / (GBPS * 1e9))


def _charged(fn, time_scale: float = 1.0) -> tuple[float, int]:
    """(device seconds, kernels) ``fn`` put on the emulated device's timeline."""
    torch.dipu.synchronize()
    emulation_stats(reset=True)
    fn()
    torch.dipu.synchronize()
    s = emulation_stats()
    return s.device_busy_s / time_scale, s.kernels


@pytest.mark.parametrize("m,k,n,dtype", [(256, 512, 384, torch.float32), (256, 512, 384, torch.bfloat16),
                                         (1, 4096, 1, torch.float32)])
def test_an_mm_costs_its_flops_or_its_bytes(m, k, n, dtype):
    ditorch.set_chip(_chip())
    a, b = torch.randn(m, k, device="dipu", dtype=dtype), torch.randn(k, n, device="dipu", dtype=dtype)
    seconds, kernels = _charged(lambda: torch.mm(a, b))
    size = a.element_size()
    want = _roofline(2 * m * k * n, (m * k + k * n + m * n) * size, TFLOPS["fp32" if dtype == torch.float32 else "bf16"])
    assert kernels == 1
    assert seconds == pytest.approx(want, rel=1e-6, abs=2e-9)


def test_an_add_is_memory_bound_on_what_it_reads_and_writes():
    ditorch.set_chip(_chip())
    a, b = torch.randn(1 << 20, device="dipu"), torch.randn(1 << 20, device="dipu")
    seconds, kernels = _charged(lambda: a + b)
    assert kernels == 1
    assert seconds == pytest.approx(_roofline(0, 3 * 4 * (1 << 20), 1), rel=1e-6)  # read a, b; write a + b
    seconds, _ = _charged(lambda: a.add_(b))
    assert seconds == pytest.approx(_roofline(0, 3 * 4 * (1 << 20), 1), rel=1e-6)  # read a, b; write a


def test_attention_costs_its_two_products():
    # IEEE numerics and the CPU kernel device: dipu takes the fused flash kernel, one op.
    ditorch.set_chip(_chip())
    b, h, s, d = 2, 4, 256, 64
    q, k, v = (torch.randn(b, h, s, d, device="dipu") for _ in range(3))
    seconds, kernels = _charged(lambda: F.scaled_dot_product_attention(q, k, v))
    flops = 2 * b * h * s * s * d + 2 * b * h * s * s * d  # q k^T, then p v (flop_counter's sdpa_flop_count)
    want = _roofline(flops, 4 * b * h * s * d * 4, TFLOPS["fp32"])  # q, k, v read, out written
    # fused, it is one kernel; by the math path, the same two products and a few memory-bound ops
    assert seconds == pytest.approx(want, rel=0.05), (seconds, want, kernels)


def test_flex_attention_costs_one_attention_kernel_each_way():
    """FlexAttention's dense ops on dipu (ditorch_ext/flex_attention.py) are charged as one fused
    attention kernel forward and one backward, whatever its score_mod and mask add."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ditorch.set_chip(_chip())
    b, h, s, d = 2, 4, 256, 64
    q, k, v = (torch.randn(b, h, s, d, device="dipu", requires_grad=True) for _ in range(3))
    causal = create_block_mask(lambda b_, h_, q_, k_: q_ >= k_, b, h, s, s, device="dipu")
    out = []
    seconds, kernels = _charged(lambda: out.append(flex_attention(q, k, v, score_mod=lambda x, *_: x * 0.5,
                                                                  block_mask=causal)))
    flops = 2 * b * h * s * s * d + 2 * b * h * s * s * d  # q k^T, then p v, as SDPA's
    assert kernels == 1
    assert seconds == pytest.approx(_roofline(flops, 4 * b * h * s * d * 4, TFLOPS["fp32"]), rel=1e-6, abs=2e-9)
    grad = torch.ones_like(out[0])
    seconds, kernels = _charged(lambda: out[0].backward(grad))
    # flop_counter's sdpa_backward_flop_count: the scores recomputed and four products
    flops = 2 * b * h * 5 * s * s * d
    assert kernels == 1
    assert seconds == pytest.approx(_roofline(flops, 8 * b * h * s * d * 4, TFLOPS["fp32"]), rel=1e-6, abs=2e-9)


def test_the_counted_flops_are_torchs_flop_counter_formulas():
    """mm, bmm, attention forward and backward and convolution, against FlopCounterMode (on meta
    tensors: the formulas read shapes only)."""
    from torch.utils.flop_counter import FlopCounterMode

    def counted(fn, *args) -> int:
        with FlopCounterMode(display=False) as mode:
            fn(*args)
        return mode.get_total_flops()

    def work(op: str, tensors, ints=()) -> float:
        return torch.ops.ditorch_emu.kernel_work(op, list(tensors), list(ints))[0]

    torch.set_default_device("meta")
    try:
        _flops_against_flop_counter(counted, work)
    finally:
        torch.set_default_device(None)


def _flops_against_flop_counter(counted, work) -> None:
    a, b = torch.randn(64, 96), torch.randn(96, 80)
    assert work("aten::mm", [a, b]) == counted(torch.mm, a, b)
    x, y = torch.randn(3, 64, 96), torch.randn(3, 96, 80)
    assert work("aten::bmm", [x, y]) == counted(torch.bmm, x, y)
    q, k, v = torch.randn(2, 4, 32, 16), torch.randn(2, 4, 48, 16), torch.randn(2, 4, 48, 8)
    assert work("aten::_scaled_dot_product_efficient_attention", [q, k, v]) == \
        counted(torch.ops.aten._scaled_dot_product_efficient_attention, q, k, v, None, False)
    out = torch.randn(2, 4, 32, 8)
    grad_flops = counted(lambda: torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        out, q, k, v, None, out, torch.randn(2, 4, 32), torch.tensor(0), torch.tensor(0), 0.0, [True, True, True, False]))
    assert work("aten::_scaled_dot_product_efficient_attention_backward", [out, q, k, v]) == grad_flops
    img, weight = torch.randn(2, 6, 17, 19), torch.randn(8, 3, 3, 5)  # groups=2, stride 2, padding 1, dilation 1
    conv_ints = [2, 2, 1, 1, 1, 1, 0, 0, 0, 2]  # stride, padding, dilation, transposed, output_padding, groups
    assert work("aten::convolution", [img, weight, None], conv_ints) == \
        counted(lambda: F.conv2d(img, weight, stride=2, padding=1, groups=2))


def test_the_host_never_enters_a_kernels_cost():
    # The same kernels cost the same device time whether the host runs them fast or, between
    # them, is held up (a sleep stands in for a slow or loaded host).
    ditorch.set_chip(_chip())
    a = torch.randn(128, 256, device="dipu")

    def kernels(pause: float):
        for _ in range(5):
            torch.mm(a, a.t())
            time.sleep(pause)

    fast, _ = _charged(lambda: kernels(0))
    slow, _ = _charged(lambda: kernels(0.01))
    assert fast == slow


@pytest.mark.parametrize("scale", [1.0, 3.0, 250.0])
def test_the_time_scale_multiplies_every_kernel(scale):
    ditorch.set_chip(_chip(), time_scale=scale)
    a, b = torch.randn(256, 512, device="dipu"), torch.randn(512, 384, device="dipu")
    seconds, _ = _charged(lambda: torch.mm(a, b), time_scale=scale)
    assert seconds == pytest.approx(_roofline(2 * 256 * 512 * 384, (256 * 512 + 512 * 384 + 256 * 384) * 4, 2.0),
                                    rel=1e-6, abs=2e-9)  # charged in whole nanoseconds


def test_h2_chips_keep_their_relative_speeds_on_every_kernel():
    a, b = torch.randn(256, 512, device="dipu"), torch.randn(512, 384, device="dipu")
    x = torch.randn(1 << 20, device="dipu")
    costs = {}
    for chip in "ABCD":
        ditorch.set_chip(chip)
        costs[chip] = (_charged(lambda: torch.mm(a, b))[0], _charged(lambda: x * 2)[0])
    speed = {"A": 0.75, "B": 0.75, "C": 0.25, "D": 1.75}
    for chip in "BCD":
        for i in range(2):
            # charged in whole nanoseconds: up to a few parts in 1e4 of these microsecond kernels
            assert costs["A"][i] / costs[chip][i] == pytest.approx(speed[chip] / speed["A"], rel=5e-4)


def test_the_host_falling_behind_is_counted_and_a_sync_is_not():
    ditorch.set_chip(_chip())
    from ditorch_ext import _C

    torch.dipu.synchronize()
    emulation_stats(reset=True)
    _C.occupy_device(0.002)
    time.sleep(0.010)  # the host takes 10 ms to launch the next kernel: the device idles ~8 ms
    _C.occupy_device(0.002)
    late = emulation_stats()
    assert late.late_kernels == 1 and 0.007 < late.host_late_s < 0.030, late
    torch.dipu.synchronize()  # waiting at a synchronisation point is not lateness
    time.sleep(0.010)
    _C.occupy_device(0.002)
    torch.dipu.synchronize()
    assert emulation_stats().late_kernels == 1


def test_a_datasheet_profile_is_validated_field_by_field():
    from ditorch_ext.profiles import profile_from_dict

    node = {"memory_gb": 8, "chips_per_node": 8, "nics_per_node": 4}
    sheet = profile_from_dict("F", {**node, "fp32_tflops": 40, "bf16_tflops": 624, "memory_gbps": 2800})
    assert sheet.relative_speed == pytest.approx(2.0)  # bf16 against the A100's 312
    assert sheet.datasheet.peak("fp8") == 624e12  # no fp8 unit: fp16's, else bf16's
    with pytest.raises(ValueError, match=r"missing field\(s\) \['fp32_tflops', 'memory_gbps'\] \(a speed"):
        profile_from_dict("E", node)
    with pytest.raises(ValueError, match="memory_gbps=-1 is invalid"):
        profile_from_dict("G", {**node, "fp32_tflops": 40, "memory_gbps": -1})
    with pytest.raises(ValueError, match="fp8_tflops='x' is invalid"):
        profile_from_dict("H", {**node, "fp32_tflops": 40, "memory_gbps": 100, "fp8_tflops": "x"})
