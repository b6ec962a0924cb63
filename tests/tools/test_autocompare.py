"""autocompare must name a deliberately wrong kernel, save its inputs, and stay quiet on a
correct model."""
import csv
import json

import pytest
import torch

from ditorch import tools
from dimodel import Llama, LlamaConfig
from ditorch.tools import autocompare, replay

from tools_cases import needs_dipu


def _register_wrong_silu(lib):
    """silu whose float32 kernel is 1% off (its float64 kernel, the reference, is right)."""
    lib.define("silu(Tensor x) -> Tensor")

    def kernel(x):
        y = x * torch.sigmoid(x)
        return y * 1.01 if x.dtype == torch.float32 else y

    lib.impl("silu", kernel, "CPU")
    return torch.ops.ditorch_tools_test.silu.default


def test_finds_wrong_kernel_names_it_and_saves_inputs(test_library, tmp_path):
    wrong = _register_wrong_silu(test_library)
    torch.manual_seed(0)
    x, w = torch.randn(6, 8), torch.randn(8, 5)
    with autocompare(reference="cpu", dtype=torch.float64, out_dir=tmp_path) as ac:
        h = x @ w
        y = wrong(h)
        z = torch.softmax(y, -1).sum()
    bad = ac.mismatches
    assert [r.op for r in bad] == ["ditorch_tools_test::silu"]
    assert {r.op for r in ac.results} >= {"aten::mm", "aten::_softmax", "aten::sum", "ditorch_tools_test::silu"}
    # the reported error is the kernel's bug: 1% relative
    assert bad[0].max_rel_err == pytest.approx(0.01, rel=1e-3)
    saved = bad[0].inputs_saved
    assert saved and (tmp_path / "mismatches").exists()
    # the saved inputs are the op's real inputs: re-running the right computation on them
    # gives the right answer, and replaying the capture reproduces the wrong output exactly
    meta, args, kwargs, outputs = tools.load_capture(saved)
    assert torch.equal(args[0], h)
    assert torch.equal(outputs[0], y)
    assert replay(saved).identical
    # reports on exit
    rows = list(csv.DictReader(open(tmp_path / "autocompare.csv")))
    assert {"op", "max_abs_err", "max_rel_err", "cosine", "allclose"} <= set(rows[0])
    assert [r["op"] for r in rows if r["allclose"] == "False"] == ["ditorch_tools_test::silu"]
    assert len(json.loads((tmp_path / "autocompare.json").read_text())) == len(rows)
    del z


def test_raise_on_mismatch_and_per_op_tolerance(test_library):
    wrong = _register_wrong_silu(test_library)
    x = torch.randn(4, 4)
    with pytest.raises(tools.MismatchError, match="ditorch_tools_test::silu"):
        with autocompare(dtype=torch.float64, raise_on_mismatch=True, out_dir=None):
            wrong(x)
    # a tolerance loose enough for a 1% error, for this op and dtype only, accepts it
    with autocompare(dtype=torch.float64, out_dir=None, tolerances={"silu": {torch.float32: (0.02, 1e-6)}}) as ac:
        wrong(x)
    assert ac.results and not ac.mismatches
    with autocompare(dtype=torch.float64, out_dir=None, tolerances={"silu": {torch.float16: (0.02, 1e-6)}}) as ac:
        wrong(x)
    assert ac.mismatches


def test_wrong_backward_kernel_is_found_in_the_backward_pass(test_library):
    lib = test_library
    lib.define("scale2(Tensor x) -> Tensor")
    lib.define("scale2_backward(Tensor grad) -> Tensor")
    lib.impl("scale2", lambda x: x * 2, "CPU")
    lib.impl("scale2_backward", lambda g: g * (2.02 if g.dtype == torch.float32 else 2.0), "CPU")
    ops = torch.ops.ditorch_tools_test

    class Scale2(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return ops.scale2(x)

        @staticmethod
        def backward(ctx, g):
            return ops.scale2_backward(g)

    x = torch.randn(5, requires_grad=True)
    with autocompare(dtype=torch.float64, out_dir=None) as ac:
        Scale2.apply(x).pow(2).sum().backward()
    [bad] = ac.mismatches
    assert bad.op == "ditorch_tools_test::scale2_backward"
    assert bad.phase == "backward" and bad.autograd_node.startswith("Scale2Backward")


def test_no_false_alarm_on_the_llama_forward_and_backward():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32))
    tokens = torch.randint(0, 64, (2, 17))
    with autocompare(reference="cpu", dtype=torch.float64, out_dir=None) as ac:
        model.loss(tokens).backward()
    phases = {r.phase for r in ac.results}
    assert phases == {"forward", "backward"}
    assert any(r.op == "aten::mm" and r.phase == "backward" for r in ac.results)
    assert not ac.mismatches, [str(tools.MismatchError(r)) for r in ac.mismatches[:3]]
    assert all(r.cosine > 0.999 for r in ac.results if r.max_abs_err > 1e-6)


def test_usable_as_decorator_and_state_accumulates():
    ac = autocompare(ops="mm", out_dir=None)

    @ac
    def step(a, b):
        return a @ b

    step(torch.randn(3, 3), torch.randn(3, 3))
    step(torch.randn(3, 3), torch.randn(3, 3))
    assert [r.op for r in ac.results] == ["aten::mm", "aten::mm"]


def test_in_place_optimizer_ops_are_compared_through_what_they_write():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, foreach=True)
    lin(torch.randn(4, 8)).sum().backward()
    with autocompare(dtype=torch.float64, ops="_foreach_.*", out_dir=None) as ac:
        opt.step()
    foreach = [r for r in ac.results if r.op.startswith("aten::_foreach_")]
    # _foreach_add_ returns nothing: its results are the parameters it updated (weight, bias)
    assert foreach and {r.shape for r in foreach} == {"8x8", "8"}
    assert not ac.mismatches


@needs_dipu
def test_finds_wrong_dipu_kernel_against_cpu():
    """An aten op overridden for the dipu (PrivateUse1) key with a wrong kernel, for this test only."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        def bad_softmax(x, dim, half_to_float):
            out = torch.ops.aten._softmax.default(x.cpu(), dim, half_to_float) * 1.05
            return out.to(x.device)

        lib.impl("_softmax", bad_softmax, "PrivateUse1")
        x = torch.randn(4, 8).to("dipu")
        with autocompare(reference="cpu", out_dir=None) as ac:
            (x @ x.T).softmax(-1)
        assert [r.op for r in ac.mismatches] == ["aten::_softmax"]
        assert any(r.op == "aten::mm" and r.allclose for r in ac.results)
    finally:
        lib._destroy()


CHIP_SCRIPT = """
import json, torch, ditorch
from ditorch import tools
torch.manual_seed(0)
a, b = torch.randn(64, 64), torch.randn(64, 64)
with tools.autocompare(reference="cpu", out_dir=None) as ac:
    da, db = a.to("dipu"), b.to("dipu")
    (da @ db).relu()
    da + db
print(json.dumps({"ops": sorted({r.op for r in ac.results}), "bad": sorted({r.op for r in ac.mismatches})}))
"""


@pytest.mark.slow
@needs_dipu
def test_finds_the_emulated_chips_matmul_numerics():
    """Chip D rounds matmul inputs (device layer): autocompare against the CPU must flag mm
    and nothing else."""
    import json
    import os
    import subprocess
    import sys

    from tools_cases import REPO

    proc = subprocess.run([sys.executable, "-c", CHIP_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, DITORCH_CHIP="D", PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"aten::mm", "aten::relu", "aten::add.Tensor"} <= set(found["ops"])
    assert found["bad"] == ["aten::mm"]


def test_a_call_the_reference_cannot_run_is_unchecked_never_agreeing(test_library):
    test_library.define("fp32_only(Tensor x) -> Tensor")

    def kernel(x):
        if x.dtype != torch.float32:
            raise RuntimeError(f"fp32_only: no {x.dtype} kernel")
        return x * 2

    test_library.impl("fp32_only", kernel, "CPU")
    with autocompare(dtype=torch.float64, out_dir=None) as ac:
        torch.ops.ditorch_tools_test.fp32_only(torch.randn(3))
    [result] = ac.results
    assert result.status == "reference failed" and not result.allclose
    assert "no torch.float64 kernel" in result.detail
    assert ac.unchecked == [result] and not ac.mismatches


def test_an_output_only_one_run_returned_is_a_mismatch(test_library):
    """A kernel returning one more piece in float32 than in float64 (the reference)."""
    test_library.define("pieces(Tensor x) -> Tensor[]")
    test_library.impl("pieces", lambda x: list(x.split(2 if x.dtype == torch.float32 else 3)), "CPU")
    with autocompare(dtype=torch.float64, out_dir=None) as ac:
        torch.ops.ditorch_tools_test.pieces(torch.randn(6))
    assert [r.status for r in ac.results] == ["mismatch", "mismatch", "missing"]  # shapes 2 vs 3 differ, then a third
    assert ac.mismatches[-1].output == 2 and "only the device returned output 2" in ac.mismatches[-1].detail
    with pytest.raises(tools.MismatchError, match="only the device returned output 2"):
        raise tools.MismatchError(ac.mismatches[-1])


@needs_dipu
def test_a_factory_ops_reference_runs_on_the_reference_device():
    """Chip D flushes denormals: a dipu `full` of a denormal is 0, the CPU's is not. With the
    reference still on dipu, both would be 0 and agree."""
    import ditorch

    ditorch.set_chip("D")
    try:
        with autocompare(reference="cpu", ops="full", tolerances={"full": (0.0, 0.0)}, out_dir=None) as ac:
            torch.full((3,), 1e-40, device="dipu")
    finally:
        ditorch.set_chip("host")
    assert [(r.op, r.status) for r in ac.results] == [("aten::full", "mismatch")]
