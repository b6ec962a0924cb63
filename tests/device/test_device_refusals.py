"""What the dipu device refuses and produces as hardware does: one device per op (lists included),
out= list items the kernel grows, denormals flushed exactly where a kernel wrote, and fallbacks
that cannot run. References are CPU results and CUDA's documented rules."""
import warnings

import pytest
import torch

import ditorch
import ditorch_ext

SMALLEST_NORMAL = torch.finfo(torch.float32).tiny

# Test-only ops with nothing but a CPU kernel: on dipu they reach the shim as any vendor kernel does.
_lib = torch.library.Library("ditorch_refusals", "DEF")
_lib.define("grow_into(Tensor src, *, Tensor(a!)[] out) -> ()")
_lib.define("copies(Tensor src, int n) -> Tensor[]")
_lib.define("cuda_only(Tensor src) -> Tensor")


def _grow_into(src, *, out):
    for o in out:
        o.resize_(src.shape).copy_(src)


_lib.impl("grow_into", _grow_into, "CPU")
_lib.impl("copies", lambda src, n: [src * 1.0 for _ in range(n)], "CPU")
_lib.impl("cuda_only", lambda src: src, "CUDA")


def flushed(t: torch.Tensor) -> torch.Tensor:
    """The hand-made reference of a flush-to-zero chip: |x| below the smallest normal becomes 0."""
    return torch.where(t.abs() < SMALLEST_NORMAL, torch.zeros_like(t), t)


def denormal_cases(n: int = 64, seed: int = 0) -> torch.Tensor:
    """Values on both sides of the smallest normal, both signs, and ordinary ones."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-45, 1e-41, 1e-39, SMALLEST_NORMAL, 1e-30, 1.0])
    picks = scale[torch.randint(len(scale), (n,), generator=g)]
    return picks * torch.rand(n, generator=g) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize(
    "op",
    [
        lambda d, c: torch.cat([d, c]),
        lambda d, c: torch.stack([c, d]),
        lambda d, c: torch._foreach_add([d], [c]),
        lambda d, c: torch.cat([c, c], out=d),
    ],
    ids=["cat", "stack", "foreach_add", "cat_out"],
)
def test_a_list_mixing_devices_is_refused_naming_both(op):
    d, c = torch.ones(2, device="dipu"), torch.ones(2)
    with pytest.raises(RuntimeError, match=r"same device.*dipu:0 and cpu.*Move it"):
        op(d, c)


@pytest.mark.two_devices
def test_two_dipu_devices_in_one_op_are_refused():
    with pytest.raises(RuntimeError, match=r"same device.*dipu:0 and dipu:1"):
        torch.cat([torch.ones(2, device="dipu:0"), torch.ones(2, device="dipu:1")])


def test_what_cuda_allows_beside_a_device_tensor_still_works():
    x = torch.arange(6.0)
    d = x.dipu()
    torch.testing.assert_close(d[torch.tensor([0, 4])].cpu(), x[torch.tensor([0, 4])])  # CPU indices
    torch.testing.assert_close((d * torch.tensor(2.0)).cpu(), x * 2)  # a 0-dim CPU tensor is a scalar
    d.index_put_((torch.tensor([1]),), torch.tensor(9.0))
    assert d.cpu()[1] == 9.0


def test_out_list_items_the_kernel_grows_reach_the_caller():
    src = torch.randn(3, 5)
    out = [torch.empty(0, device="dipu"), torch.empty(2, device="dipu")]
    torch.ops.ditorch_refusals.grow_into(src.dipu(), out=out)
    for o in out:
        assert o.is_dipu and o.shape == (3, 5)
        torch.testing.assert_close(o.cpu(), src, rtol=0, atol=0)


def test_flush_to_zero_chip_flushes_list_results_and_in_place_list_updates():
    values = denormal_cases()
    ditorch.set_chip("D")
    for got in torch.ops.ditorch_refusals.copies(values.dipu(), 2):
        assert torch.equal(got.cpu(), flushed(values))
    # A fused optimizer step updates its parameter list in place inside one kernel. With lr=0 and no
    # decay the parameters keep their values: the chip's only change is the flush.
    params = [values.dipu()]
    grads, exp_avgs, exp_avg_sqs = [torch.ones_like(params[0])], [torch.zeros_like(params[0])], [torch.zeros_like(params[0])]
    steps = [torch.ones((), device="dipu")]  # the fused kernel reads the step count, the optimizer increments it
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=0.0, beta1=0.9, beta2=0.999,
                        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    assert torch.equal(params[0].cpu(), flushed(values))


def test_flush_to_zero_chip_leaves_a_views_base_alone():
    values = denormal_cases(seed=1)
    ditorch.set_chip("D")
    base = values.dipu()
    window = base.unfold(0, 4, 4)  # a view served by the shim's kernel
    assert torch.equal(base.cpu(), values)
    assert torch.equal(window.cpu(), values.unfold(0, 4, 4))


def test_an_op_with_neither_vendor_nor_cpu_kernel_is_an_error_not_a_fallback():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match=f"cuda_only has no kernel for the '{ditorch.vendor_name()}' vendor and none on the CPU"):
            torch.ops.ditorch_refusals.cuda_only(torch.ones(2, device="dipu"))
    assert ditorch_ext.cpu_fallback_counts() == {}
    assert not [w for w in caught if "not supported by" in str(w.message)]

