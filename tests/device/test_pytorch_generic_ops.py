"""Ops PyTorch's own device-generic tests found behaving differently on dipu than on CPU: each
against the CPU's result (or its error) on the same inputs."""
import warnings

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


@pytest.mark.parametrize("index", [torch.tensor([], dtype=torch.long), torch.tensor([0, 2])], ids=["empty", "two"])
def test_index_fill_refuses_a_cpu_index_vector_as_cuda_does(index):
    """CUDA's index_fill_ runs a TensorIterator over the index restrided to the input's rank, which
    admits no CPU tensor beside a device one (only 0-dim CPU scalars), empty or not. (PyTorch's
    test_stable_sort_against_numpy fills with CPU indices only after returning early on CUDA.)"""
    with pytest.raises(RuntimeError, match=r"index_fill_.*same device.*dipu:0 and cpu"):
        torch.zeros(3, device="dipu").index_fill_(0, index, 1.0)
    filled = torch.zeros(3, device="dipu").index_fill_(0, index.to("dipu"), 1.0)
    assert torch.equal(filled.cpu(), torch.zeros(3).index_fill_(0, index, 1.0))


@pytest.mark.parametrize("case", ["boundary", "values", "sorter", "out", "bucketize"])
def test_searchsorted_warns_of_non_contiguous_tensors_as_the_cpu_does(case):
    """The CPU kernel's performance warnings reach the caller from dipu too (with warn-always on,
    as PyTorch's tests of them set it: they are TORCH_WARN_ONCE)."""
    def run(device: str) -> list[str]:
        b, v = torch.arange(10.0, device=device), torch.tensor([1.0, 0.0, 5.0], device=device)
        args = {"boundary": lambda: torch.searchsorted(b[::2], v),
                "values": lambda: torch.searchsorted(b, v[::2]),
                "sorter": lambda: torch.searchsorted(
                    b.flip(0), v, sorter=torch.arange(9, -1, -1, device=device).repeat_interleave(2)[::2]),
                "out": lambda: torch.searchsorted(b[::2], v, out=torch.empty(3, dtype=torch.long, device=device)),
                "bucketize": lambda: torch.bucketize(v[::2], b[::2])}[case]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args()
        # the words, not where in C++ they were raised
        return sorted(str(w.message).split(" (Triggered internally at")[0] for w in caught
                      if "non-contiguous" in str(w.message))

    previous = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        on_cpu, on_dipu = run("cpu"), run("dipu")
    finally:
        torch.set_warn_always(previous)
    assert on_cpu and on_dipu == on_cpu


@pytest.mark.parametrize("op, dtype", [
    (lambda t, out: torch.nonzero(t, out=out), torch.long),
    (lambda t, out: torch.add(t, 1, out=out), torch.float32),
    (lambda t, out: out.add_(t.sum()), torch.float32),
], ids=["nonzero out", "add out", "add_ self"])
def test_a_0_dim_cpu_tensor_the_op_writes_is_refused_as_cuda_refuses_it(op, dtype):
    """A 0-dim CPU tensor may be read beside device tensors as a scalar (CUDA's TensorIterator
    allows CPU scalars as inputs only), never written: the result would stay on the host."""
    t = torch.tensor([0.0, 1.0, 2.0], device="dipu")
    with pytest.raises(RuntimeError, match=r"same device.*dipu:0 and cpu"):
        op(t, torch.empty([], dtype=dtype))
    assert torch.equal((t * torch.tensor(2.0)).cpu(), torch.tensor([0.0, 2.0, 4.0]))  # read, it is a scalar


def test_searchsorted_on_dipu_warns_once_of_its_own_after_the_cpu_warned():
    """The CPU's kernel warns once per program, and so does a device's own kernel (a flag per
    library); dipu's warning must not be spent by a CPU call (PyTorch's test_bucketization runs
    its CPU case first). A fresh process, where no warning was spent yet."""
    import subprocess
    import sys

    code = ("import warnings, torch, ditorch\n"
            "b = torch.arange(10.0)\n"
            "torch.searchsorted(b[::2], b)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    d = b.to('dipu')\n"
            "    torch.searchsorted(d[::2], d)\n"
            "    torch.searchsorted(d[::2], d)\n"
            "print(sum('boundary tensor is non-contiguous' in str(x.message) for x in w))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "1"
