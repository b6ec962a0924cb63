import pytest
import torch

from ditorch.tools import dtype_cast, fallback, time_ops

from tools_cases import needs_dipu


def test_dtype_cast_runs_the_op_in_the_target_dtype():
    torch.manual_seed(0)
    x = (torch.randn(16, 64) * 8).bfloat16()
    with dtype_cast({torch.bfloat16: torch.float32}, ops="softmax") as dc:
        got = x.softmax(-1)
        other = x * 3  # not selected: stays bf16 math
    expected = x.float().softmax(-1).bfloat16()   # independent: fp32 softmax, rounded once
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert torch.equal(other, x * 3)
    assert dc.calls == 1


def test_dtype_cast_changes_the_numbers_of_an_inexact_op():
    torch.manual_seed(0)
    x = torch.randn(100_000) * 10
    with dtype_cast({torch.float32: torch.float64}, ops="sin"):
        got = x.sin()
    expected = x.double().sin().float()   # fp64 sin, rounded once
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert not torch.equal(x.sin(), expected)  # the fp32 kernel is off by an ulp here and there


def test_dtype_cast_in_place_writes_back_into_the_callers_tensor():
    a = torch.tensor([1.0, 256.0, 3.0]).bfloat16()
    b = torch.tensor([1 / 3, 1.0, 1e-3]).bfloat16()
    expected = (a.float() + b.float()).bfloat16()
    with dtype_cast({torch.bfloat16: torch.float64}, ops="add_"):
        out = a.add_(b)
    assert out is a and a.dtype == torch.bfloat16 and torch.equal(a, expected)


def test_dtype_cast_bad_mapping():
    with pytest.raises(ValueError, match="mapping"):
        dtype_cast({})
    with pytest.raises(TypeError, match="dtypes"):
        dtype_cast({"bf16": torch.float32})


def test_fallback_needs_ops_and_leaves_cpu_tensors_alone():
    with pytest.raises(ValueError, match="name the ops"):
        fallback(ops=None)
    with fallback(ops="mm") as fb:
        torch.randn(3, 3) @ torch.randn(3, 3)
    assert fb.calls == 0


def test_time_ops_counts_each_call_per_op_and_phase(tmp_path):
    a = torch.randn(32, 32, requires_grad=True)
    with time_ops(path=tmp_path / "t.csv") as t:
        for _ in range(3):
            a @ a
        (a @ a).sum().backward()
    assert t.timings[("aten::mm", "forward")].calls == 4
    assert t.timings[("aten::mm", "backward")].calls == 2
    table = t.table()
    assert "aten::mm" in table and "backward" in table
    assert (tmp_path / "t.csv").read_text().startswith("op,phase,calls,total_us,max_us,mean_us")
    assert all(r.total_us > 0 for r in t.rows())


@needs_dipu
def test_fallback_routes_a_broken_dipu_kernel_to_cpu():
    lib = torch.library.Library("aten", "IMPL")
    try:
        def bad_softmax(x, dim, half_to_float):
            return (torch.ops.aten._softmax.default(x.cpu(), dim, half_to_float) * 2).to(x.device)

        lib.impl("_softmax", bad_softmax, "PrivateUse1")
        x = torch.randn(4, 8)
        d = x.to("dipu")
        assert not torch.allclose(d.softmax(-1).cpu(), x.softmax(-1))
        with fallback(ops="softmax") as fb:
            got = d.softmax(-1)
        assert got.device.type == "dipu" and fb.calls == 1
        assert torch.equal(got.cpu(), x.softmax(-1))
        buf = torch.zeros(3, device="dipu")
        with fallback(ops="add_"):
            buf.add_(torch.ones(3, device="dipu"))   # in-place: written back on dipu
        assert buf.device.type == "dipu" and torch.equal(buf.cpu(), torch.ones(3))
    finally:
        lib._destroy()
