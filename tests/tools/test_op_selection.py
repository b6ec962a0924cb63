import pytest
import torch

from ditorch.tools import OpSelector, op_names

aten = torch.ops.aten


def test_names_cover_overload_packet_and_families():
    names = op_names(aten.addmm.default)
    for expected in ("aten::addmm", "addmm", "aten.addmm", "aten.addmm.default", "matmul", "linear"):
        assert expected in names
    assert "softmax" in op_names(aten._softmax.default)
    assert "softmax" in op_names(aten._softmax_backward_data.default)
    assert "layer_norm" in op_names(aten.native_layer_norm_backward.default)


def test_regex_selection_like_the_issue_example():
    sel = OpSelector("matmul|softmax|.*norm.*")
    assert sel(aten.mm.default) and sel(aten.bmm.default) and sel(aten._softmax.default)
    assert sel(aten.native_layer_norm.default) and sel(aten.native_layer_norm_backward.default)
    assert not sel(aten.add.Tensor) and not sel(aten.mul.Tensor)


def test_views_never_selected_and_skip_wins():
    sel = OpSelector(None, skip="add")
    assert not sel(aten.t.default) and not sel(aten.view.default)
    assert not sel(aten.add.Tensor) and sel(aten.mul.Tensor)


def test_noncomparable_skipped_unless_named():
    assert not OpSelector(skip_noncomparable=True)(aten.bernoulli_.float)
    assert not OpSelector(skip_noncomparable=True)(aten.empty_like.default)
    assert OpSelector("bernoulli_", skip_noncomparable=True)(aten.bernoulli_.float)


@pytest.mark.parametrize("bad", ["", "mm(", ["mm", ""], [3]])
def test_bad_patterns_are_clear_errors(bad):
    with pytest.raises((ValueError, TypeError), match="ops"):
        OpSelector(bad)
