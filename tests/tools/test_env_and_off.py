"""Tools from DITORCH_TOOLS, and nothing left hooked when tools are off."""
import csv
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ditorch.tools import autocompare, capture, overflow_check, time_ops
from ditorch.tools.env import parse

from tools_cases import REPO

SCRIPT = textwrap.dedent("""
    import torch
    import ditorch.tools
    torch.manual_seed(0)
    a = torch.randn(8, 8, requires_grad=True)
    (a @ a).softmax(-1).sum().backward()
    print("stack", torch._C._len_torch_dispatch_stack())
""")


def _run(tmp_path, spec, script=SCRIPT, args=()):
    env = dict(os.environ, DITORCH_TOOLS=spec, DITORCH_TOOLS_DIR=str(tmp_path / "out"), PYTHONPATH=REPO)
    path = tmp_path / "train.py"
    path.write_text(script)
    return subprocess.run([sys.executable, *args, str(path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


def test_environment_turns_tools_on_for_an_unchanged_script(tmp_path):
    proc = _run(tmp_path, "autocompare:ops=mm|softmax,dtype=float64;time_ops")
    assert proc.returncode == 0, proc.stderr
    assert "stack 2" in proc.stdout                      # both modes were active in the script
    rows = list(csv.DictReader(open(tmp_path / "out" / "autocompare.csv")))
    assert {r["op"] for r in rows} == {"aten::mm", "aten::_softmax", "aten::_softmax_backward_data"}
    assert {r["phase"] for r in rows} == {"forward", "backward"}
    assert all(r["allclose"] == "True" for r in rows)
    assert (tmp_path / "out" / "time_ops.csv").exists() and "aten::mm" in proc.stderr   # table at exit


def test_module_runner_for_scripts_that_never_import_ditorch(tmp_path):
    script = "import torch\na = torch.randn(4, 4)\nprint('stack', torch._C._len_torch_dispatch_stack())\na @ a\n"
    proc = _run(tmp_path, "capture:ops=mm", script, args=("-m", "ditorch.tools"))
    assert proc.returncode == 0, proc.stderr
    assert "stack 1" in proc.stdout
    assert len(list((tmp_path / "out" / "capture").glob("mm_*/meta.json"))) == 1


def test_bad_environment_values_are_clear_errors():
    with pytest.raises(ValueError, match="unknown tool 'autocompar'"):
        parse("autocompar:ops=mm")
    with pytest.raises(ValueError, match="expected key=value"):
        parse("autocompare:mm")
    with pytest.raises(ValueError, match="not a torch dtype"):
        parse("autocompare:dtype=float65")
    with pytest.raises(ValueError, match="map=SOURCE>TARGET"):
        parse("dtype_cast:ops=softmax")
    with pytest.raises(ValueError, match="bad option for time_ops"):
        parse("time_ops:colour=red")
    [tool] = parse("dtype_cast:map=bfloat16>float32+float16>float32,ops=softmax")
    assert tool.mapping == {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def test_nothing_is_hooked_before_during_or_after_use(tmp_path):
    assert torch._C._len_torch_dispatch_stack() == 0       # importing ditorch.tools hooks nothing
    tools = [autocompare(out_dir=None), overflow_check(), capture(path=tmp_path), time_ops()]
    for tool in tools:
        with tool:
            assert torch._C._len_torch_dispatch_stack() == 1
        assert torch._C._len_torch_dispatch_stack() == 0
    # an exception inside the tool still takes it off the stack
    with pytest.raises(RuntimeError):
        with time_ops():
            raise RuntimeError("boom")
    assert torch._C._len_torch_dispatch_stack() == 0


def test_nested_tools_see_only_the_programs_ops(tmp_path):
    """A tool's own work (host copies, reference runs, checks) is hidden from tools around it."""
    a = torch.randn(8, 8)
    with time_ops() as outer:
        with autocompare(dtype=torch.float64, out_dir=None) as inner, overflow_check(), capture(path=tmp_path):
            (a @ a).relu()
    assert {op for op, _ in outer.timings} == {"aten::mm", "aten::relu"}
    assert all(r.calls == 1 for r in outer.rows())
    assert {r.op for r in inner.results} == {"aten::mm", "aten::relu"}
