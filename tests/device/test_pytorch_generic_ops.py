"""Ops PyTorch's own device-generic tests found behaving differently on dipu than on CPU: each
against the CPU's result (or its error) on the same inputs."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ditorch  # noqa: F401


@st.composite
def mode_cases(draw):
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 3, shape, generator=g).to(dtype)  # few distinct values: real modes, ties
    return x, dim, draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(case=mode_cases())
def test_mode_equals_the_cpus(case):
    x, dim, keepdim = case
    want = torch.mode(x, dim, keepdim)
    got = torch.mode(x.dipu(), dim, keepdim)
    assert torch.equal(got.values.cpu(), want.values) and torch.equal(got.indices.cpu(), want.indices)
    values, indices = torch.empty(0, dtype=x.dtype, device="dipu"), torch.empty(0, dtype=torch.long, device="dipu")
    torch.mode(x.dipu(), dim, keepdim, out=(values, indices))
    assert torch.equal(values.cpu(), want.values) and torch.equal(indices.cpu(), want.indices)
    assert torch.equal(x.dipu().mode(dim, keepdim).values.cpu(), want.values)


def test_mode_refuses_what_the_cpu_refuses_with_the_cpus_words():
    x = torch.ones(3, 4, dtype=torch.complex64)
    with pytest.raises(RuntimeError) as cpu:
        torch.mode(x, 1)
    with pytest.raises(RuntimeError) as dipu:
        torch.mode(x.dipu(), 1)
    assert str(dipu.value).splitlines()[0] == str(cpu.value).splitlines()[0]
