"""Sparse COO tensors on dipu compute what the same tensors compute on the CPU (creation,
coalescing, densifying, indexing, arithmetic, reductions, products, autograd), over generated
tensors with duplicate indices, hybrid (dense) dimensions and empty ones; quantized dipu tensors
are refused naming the op."""
from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ditorch  # noqa: F401


@st.composite
def sparse_tensors(draw):
    """(indices, values, size) of a COO tensor: 1-3 sparse dims, 0-1 dense dims, duplicates allowed."""
    sparse_dims = draw(st.integers(1, 3))
    size = [draw(st.integers(1, 5)) for _ in range(sparse_dims)]
    dense = [draw(st.integers(1, 3))] if draw(st.booleans()) else []
    nnz = draw(st.integers(0, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    indices = torch.stack([torch.randint(0, n, (nnz,), generator=g) for n in size]) if nnz else \
        torch.zeros(sparse_dims, 0, dtype=torch.long)
    values = torch.randn(nnz, *dense, generator=g)
    return indices, values, size + dense


def _same(dipu_result, cpu_result) -> None:
    if isinstance(cpu_result, torch.Tensor):
        assert dipu_result.device.type == "dipu" and dipu_result.layout == cpu_result.layout
        got = dipu_result.cpu()
        if cpu_result.is_sparse:
            assert got.is_coalesced() == cpu_result.is_coalesced()
            torch.testing.assert_close(got._indices(), cpu_result._indices(), rtol=0, atol=0)
            torch.testing.assert_close(got._values(), cpu_result._values())
        else:
            torch.testing.assert_close(got, cpu_result)
    else:
        assert dipu_result == cpu_result


OPS = {
    "coalesce": lambda s, d: s.coalesce(),
    "to_dense": lambda s, d: s.to_dense(),
    "coalesced indices": lambda s, d: s.coalesce().indices(),
    "coalesced values": lambda s, d: s.coalesce().values(),
    "nnz": lambda s, d: s._nnz(),
    "add": lambda s, d: s + s * 2,
    "sub dense": lambda s, d: d - s,
    "mul": lambda s, d: s.coalesce() * s.coalesce(),
    "neg": lambda s, d: -s,
    "sum": lambda s, d: torch.sparse.sum(s),
    "sum dim 0": lambda s, d: torch.sparse.sum(s, 0),
    "index_select": lambda s, d: s.index_select(0, torch.tensor([0, 0], device=s.device)),
    "transpose": lambda s, d: s.transpose(0, s.sparse_dim() - 1),
    "clone": lambda s, d: s.clone(),
    "add_ in place": lambda s, d: s.clone().add_(s),
    "mul_ in place": lambda s, d: s.coalesce().mul_(3),
    "zero_": lambda s, d: s.clone().zero_(),
    "sparse_mask": lambda s, d: d.sparse_mask(s.coalesce()),
    "to_sparse of dense": lambda s, d: d.to_sparse(),
}


@settings(max_examples=60, deadline=None)
@given(case=sparse_tensors(), op=st.sampled_from(sorted(OPS)))
def test_sparse_ops_on_dipu_compute_what_they_compute_on_the_cpu(case, op):
    indices, values, size = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the counted CPU fallbacks' first-use warnings
        results = {}
        for device in ("cpu", "dipu"):
            s = torch.sparse_coo_tensor(indices, values, size, device=device)
            d = torch.linspace(-1, 1, s.numel()).reshape(size).to(device)
            results[device] = OPS[op](s, d)
    _same(results["dipu"], results["cpu"])


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 5), nnz=st.integers(0, 8), seed=st.integers(0, 2**16))
def test_a_sparse_product_trains_on_dipu_as_on_the_cpu(rows, cols, nnz, seed):
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randint(0, rows, (nnz,), generator=g), torch.randint(0, cols, (nnz,), generator=g)])
    values = torch.randn(nnz, generator=g)
    grads = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for device in ("cpu", "dipu"):
            s = torch.sparse_coo_tensor(indices, values, (rows, cols), device=device).coalesce().requires_grad_()
            w = torch.linspace(-1, 1, cols * 2).reshape(cols, 2).to(device).requires_grad_()
            torch.sparse.mm(s, w).pow(2).sum().backward()
            grads[device] = (s.grad, w.grad)
    _same(grads["dipu"][0], grads["cpu"][0])
    _same(grads["dipu"][1], grads["cpu"][1])


def test_a_sparse_tensor_moves_between_cpu_and_dipu_whole():
    s = torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), torch.tensor([1.0, 2.0, 3.0]), (4,))
    on_dipu = s.to("dipu")
    assert on_dipu.is_sparse and on_dipu._indices().device.type == "dipu" and on_dipu._values().device.type == "dipu"
    back = on_dipu.cpu()
    assert back.device.type == "cpu" and torch.equal(back.to_dense(), s.to_dense())
    on_dipu.copy_(s * 2)
    assert torch.equal(on_dipu.to_dense().cpu(), (s * 2).to_dense())


def test_quantized_tensors_are_refused_naming_the_op():
    q = torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8)
    with pytest.raises(NotImplementedError, match=r"aten::\w+: quantized tensors .* are not supported on dipu"):
        q.to("dipu")
