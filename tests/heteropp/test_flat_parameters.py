"""A stage's parameters and gradients as views of two flat buffers (heteropp/runtime/
flat_parameters.py): training through the buffers equals training the same module without them,
and nothing re-points a parameter or its gradient away from its buffer."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from heteropp.runtime.flat_parameters import FlatParameters


def _module(widths: list[int], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 9), min_size=2, max_size=5), pad_to=st.integers(1, 8),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_training_through_the_buffers_equals_training_without_them(widths, pad_to, steps, seed):
    plain = _module(widths, seed)
    flat_module = copy.deepcopy(plain)
    flat = FlatParameters(list(flat_module.parameters()), pad_to=pad_to)
    assert flat.data.numel() % pad_to == 0 and flat.data.numel() - flat.numel < pad_to
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=0.01)
    opt_flat = torch.optim.AdamW(flat_module.parameters(), lr=0.01)
    x = torch.randn(4, widths[0], generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        for module in (plain, flat_module):
            module(x).square().sum().backward()
            module(x).sum().backward()  # a second micro-batch accumulates into the same buffer
        opt_plain.step()
        opt_flat.step()
        opt_plain.zero_grad(set_to_none=True)
        flat.zero_grad()
    for p, q in zip(plain.parameters(), flat_module.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    # every parameter and gradient is still a view of its buffer, and the padding is untouched
    for (a, b), p in zip(flat.ranges, flat_module.parameters()):
        assert p.data_ptr() == flat.data[a:b].data_ptr() and p.grad.data_ptr() == flat.grad[a:b].data_ptr()
    assert not flat.data[flat.numel:].any() and not flat.grad.any()


def test_pack_and_unpack_lay_tensors_out_as_the_buffers():
    module = _module([3, 4, 2], 0)
    flat = FlatParameters(list(module.parameters()), pad_to=5)
    per_param = [torch.full_like(p, i + 1.0) for i, p in enumerate(module.parameters())]
    packed = flat.pack(per_param)
    assert packed.numel() == flat.data.numel() and not packed[flat.numel:].any()
    for got, want in zip(flat.unpack(packed), per_param):
        assert torch.equal(got, want)


def test_parameters_of_mixed_dtypes_are_refused():
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one dtype on one device"):
        FlatParameters(params)
    with pytest.raises(ValueError, match="pad_to=0"):
        FlatParameters(params[:1], pad_to=0)
