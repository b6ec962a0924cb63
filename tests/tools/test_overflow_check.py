import pytest
import torch

from ditorch.tools import NonFiniteError, overflow_check, replay


def test_stops_at_the_first_op_producing_inf(tmp_path):
    x = torch.tensor([1.0, 50.0, 100.0])
    reached = []
    with pytest.raises(NonFiniteError) as info:
        with overflow_check(out_dir=tmp_path):
            y = x * 2.0             # finite
            z = torch.exp(y)        # exp(200) overflows float32: the culprit
            reached.append(True)    # never runs: the check stopped at exp
            (z * 0).sum()
    found = info.value.overflow
    assert found.op == "aten::exp" and found.phase == "forward"
    assert not reached
    assert found.inputs[0].max == 200.0 and found.inputs[0].n_inf == 0
    assert found.outputs[0].n_inf == 2
    assert "aten::exp" in str(info.value)
    # the saved inputs replay to the same infinities
    assert replay(found.inputs_saved).identical


def test_masking_with_inf_is_not_an_overflow_but_new_nan_is():
    scores = torch.randn(4, 4)
    mask = torch.ones(4, 4, dtype=torch.bool).triu(1)
    with overflow_check(on_overflow="record") as oc:
        masked = scores.masked_fill(mask, float("-inf"))   # -inf given, not produced
        masked.softmax(-1)                                 # -inf in, finite out
        bad = masked - masked                              # -inf - -inf = nan: a new kind
    assert [o.op for o in oc.overflows] == ["aten::sub.Tensor"]
    assert torch.isnan(bad).any()


def test_overflow_in_backward_is_reported_with_its_autograd_node():
    x = torch.tensor([1e20, 1.0], requires_grad=True)
    y = x.pow(2)  # 1e40 overflows in forward already; record and look at the backward too
    with overflow_check(on_overflow="record") as oc:
        loss = (x * 1e30).sum()
        loss.backward(torch.tensor(1e30))   # grad = 1e30 * 1e30 -> inf in the backward mul
    back = [o for o in oc.overflows if o.phase == "backward"]
    assert back and back[0].op == "aten::mul.Tensor" and back[0].autograd_node.startswith("MulBackward")
    del y


def test_in_place_ops_are_judged_on_their_inputs_before_the_write():
    a = torch.tensor([1e38, 1.0])
    b = torch.tensor([float("inf"), 1.0])
    with overflow_check(on_overflow="record") as oc:
        b.mul_(2.0)   # inf in, inf out: not an overflow
        a.mul_(10.0)  # finite in, inf out: overflow
    [found] = oc.overflows
    assert found.op.startswith("aten::mul_") and found.index == 1
    assert found.inputs[0].n_inf == 0 and found.inputs[0].max == float(torch.tensor(1e38))  # stats from before the write


def test_bad_argument():
    with pytest.raises(ValueError, match="on_overflow"):
        overflow_check(on_overflow="stop")
