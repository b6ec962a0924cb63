import json

import torch

from ditorch.cli import main as ditorch_main
from ditorch.tools import capture, find_captures, load_capture, replay

from tools_cases import needs_dipu


def _train_step(tmp_path, ops="addmm|mm"):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(32, 16, requires_grad=True)
    with capture(path=tmp_path, ops=ops) as cap:
        out = lin(x)
        out.tanh().sum().backward()
    return cap, lin, x, out


def test_captures_forward_and_gradient_ops_and_replays_bit_for_bit(tmp_path):
    cap, lin, x, out = _train_step(tmp_path)
    metas = [json.loads((d / "meta.json").read_text()) for d in cap.saved]
    assert [m["op"] for m in metas if m["phase"] == "forward"] == ["aten::addmm"]
    backward = [m for m in metas if m["phase"] == "backward"]
    assert {m["op"] for m in backward} == {"aten::mm"} and len(backward) == 2  # grad of x and of W
    assert all(m["autograd_node"].startswith("AddmmBackward") for m in backward)
    # the forward capture holds the real output; its layout (the weight is used transposed)
    # is the layout the kernel saw
    meta, args, kwargs, outputs = load_capture(tmp_path / f"addmm_{metas[0]['index']}")
    assert torch.equal(outputs[0], out.detach())
    assert args[2].stride() == lin.weight.t().stride()
    # gradients: one of the backward mm outputs is x.grad
    grads = [load_capture(d)[3][0] for d in cap.saved[1:]]
    assert any(torch.equal(g, x.grad) for g in grads)
    for d in find_captures(tmp_path):
        assert replay(d).identical
    assert ditorch_main(["replay", str(tmp_path)]) == 0


def test_replay_reports_a_different_output(tmp_path, capsys):
    cap, *_ = _train_step(tmp_path, ops="addmm")
    [d] = cap.saved
    outputs = torch.load(d / "outputs.pt")
    outputs[0][0, 0] = torch.nextafter(outputs[0][0, 0], torch.tensor(float("inf")))  # one ulp
    torch.save(outputs, d / "outputs.pt")
    result = replay(d)
    assert not result.identical and result.differences[0].max_abs_err > 0
    assert ditorch_main(["replay", str(d)]) == 1
    assert "DIFFERENT" in capsys.readouterr().out


def test_replay_errors_are_clear(tmp_path, capsys):
    assert ditorch_main(["replay", str(tmp_path / "nope")]) == 2
    assert "no such capture directory" in capsys.readouterr().err
    assert ditorch_main(["replay", str(tmp_path)]) == 2
    assert "contains no captures" in capsys.readouterr().err


def test_optimizer_step_in_place_ops_replay_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, foreach=True)
    lin(torch.randn(4, 8)).sum().backward()
    opt.step()
    lin(torch.randn(4, 8)).sum().backward()
    before = lin.weight.detach().clone()
    with capture(path=tmp_path, ops="_foreach_.*") as cap:
        opt.step()
    assert len(cap.saved) >= 5
    # an in-place update's captured result is the parameter after the step
    assert not torch.equal(before, lin.weight)
    for d in cap.saved:
        assert replay(d).identical, d


def test_max_calls_bounds_captures(tmp_path):
    a = torch.randn(4, 4)
    with capture(path=tmp_path, ops="mm", max_calls=2) as cap:
        for _ in range(5):
            a @ a
    assert len(cap.saved) == 2


@needs_dipu
def test_dipu_capture_replays_on_dipu_and_on_cpu(tmp_path):
    a = torch.randn(8, 8).to("dipu")
    with capture(path=tmp_path, ops="mm|_softmax") as cap:
        (a @ a).softmax(-1)
    for d in cap.saved:
        assert json.loads((d / "meta.json").read_text())["devices"] == ["dipu:0"]
    assert ditorch_main(["replay", str(tmp_path), "--device", "dipu"]) == 0


@needs_dipu
def test_a_capture_records_the_chip_set_in_the_program_and_replay_notes_another(tmp_path):
    import ditorch

    ditorch.set_chip("D")
    try:
        a = torch.randn(4, 4).to("dipu")
        with capture(path=tmp_path, ops="mm") as cap:
            a @ a
    finally:
        ditorch.set_chip("host")
    [saved] = cap.saved
    assert json.loads((saved / "meta.json").read_text())["chip"] == "D"
    assert "captured on chip D, replayed on chip host" in replay(saved, "dipu").note
