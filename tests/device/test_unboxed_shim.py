"""The shim's unboxed entry (UnboxedShim.cpp) for hot ops, against CPU results: in-place results
are the caller's own tensor, kernel results become dipu tensors of the right device, re-used alias
tensors carry each call's dtype, shape, strides and lazy conjugation, and every case that is not
plain goes to the boxed shim (mixed devices refused, ops the vendor lacks fall back, chips with
numerics of their own reproduce them)."""
import gc
import random
import threading

import pytest
import torch

import ditorch
import ditorch_ext

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.complex64]


def _random_tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=g)
    elif dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        t = torch.randint(-9, 10, shape, generator=g, dtype=dtype)
    if t.dim() >= 2 and rng.random() < 0.5:
        t = t.transpose(0, 1)  # non-contiguous strides
    if dtype.is_complex and rng.random() < 0.5:
        t = t.conj()  # the lazy conjugate bit
    return t


def test_random_calls_agree_with_cpu_across_dtypes_shapes_and_strides():
    # Consecutive calls of different dtypes and shapes re-use the same spare alias tensors.
    rng = random.Random(7)
    for _ in range(300):
        dtype = rng.choice(DTYPES)
        a, b = _random_tensor(rng, dtype), _random_tensor(rng, dtype)
        try:
            expect = {"add": a + b, "mul": a * b, "sub": a - b, "neg": -a}
        except RuntimeError:
            continue  # shapes that do not broadcast: nothing to compare
        da, db = a.to("dipu"), b.to("dipu")
        got = {"add": da + db, "mul": da * db, "sub": da - db, "neg": -da}
        for name, value in got.items():
            assert value.device == torch.device("dipu:0"), name
            assert value.dtype == expect[name].dtype and value.shape == expect[name].shape, name
            torch.testing.assert_close(value.cpu(), expect[name], msg=f"{name} {dtype} {a.shape} {b.shape}")


def test_in_place_results_are_the_callers_tensor_and_views_write_through():
    base = torch.arange(12.0).view(3, 4)
    d = base.to("dipu")
    view = d[:, 1::2]
    out = view.mul_(10.0)
    assert out is view
    expect = base.clone()
    expect[:, 1::2] *= 10.0
    torch.testing.assert_close(d.cpu(), expect)
    x = torch.ones(3, device="dipu")
    assert x.add_(torch.ones(3, device="dipu"), alpha=2) is x
    assert x.cpu().tolist() == [3.0, 3.0, 3.0]
    assert x.zero_() is x and x.cpu().tolist() == [0.0, 0.0, 0.0]


def test_threads_that_exit_leave_their_spares_and_results_sound():
    # Each thread keeps spare alias tensors and adopted-block records for its next op, released
    # when it exits; results it made live on and are freed by the main thread, whose spares then
    # hold records that thread made.
    rng = random.Random(11)
    firsts = [_random_tensor(rng, torch.float32) for _ in range(40)]
    inputs = [(a, torch.randn(a.shape, generator=torch.Generator().manual_seed(i))) for i, a in enumerate(firsts)]
    results: list = []
    gc.collect()  # other tests' garbage, which a collection during this one would count off
    start = torch.dipu.memory_allocated()

    def work() -> None:
        for a, b in inputs:
            da, db = a.to("dipu"), b.to("dipu")
            results.append((da * db + da, da.sub_(db)))

    for _ in range(3):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    assert len(results) == 3 * len(inputs)
    for i, (mul_add, sub) in enumerate(results):
        a, b = inputs[i % len(inputs)]
        torch.testing.assert_close(mul_add.cpu(), a * b + a)
        torch.testing.assert_close(sub.cpu(), a - b)
    assert torch.dipu.memory_allocated() > start
    del mul_add, sub
    results.clear()
    assert torch.dipu.memory_allocated() == start  # freed on this thread, every block counted off
    for a, b in inputs:  # this thread's ops after it took the exited threads' records
        torch.testing.assert_close((a.to("dipu") + b.to("dipu")).cpu(), a + b)


@pytest.mark.two_devices
def test_results_live_on_the_operands_device_and_count_in_its_memory():
    with torch.dipu.device(1):
        a = torch.ones(256, 256, device="dipu:1")
        before = torch.dipu.memory_allocated(1)
        c = a + a
        assert c.device == torch.device("dipu:1")
        assert c.untyped_storage().device == torch.device("dipu:1")
        assert torch.dipu.memory_allocated(1) - before >= 256 * 256 * 4
        c.resize_(512, 512)  # a result's storage grows like any dipu storage
        assert c.shape == (512, 512)
        del c


def test_a_cpu_scalar_operand_is_allowed_and_a_cpu_tensor_is_refused():
    d = torch.arange(4.0, device="dipu")
    assert (d * torch.tensor(2.0)).cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(RuntimeError, match="expected all tensors to be on the same device"):
        d + torch.ones(4)


def test_an_op_the_vendor_lacks_falls_back_to_the_cpu():
    ditorch_ext.set_unsupported_ops(["aten::add.Tensor"])
    with pytest.warns(UserWarning, match="aten::add.Tensor is not supported"):
        out = torch.ones(2, device="dipu") + torch.ones(2, device="dipu")
    assert out.device.type == "dipu" and out.cpu().tolist() == [2.0, 2.0]
    assert ditorch_ext.cpu_fallback_counts().get("aten::add.Tensor") == 1


def test_a_chip_with_numerics_of_its_own_keeps_them():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 32, generator=g)
    host = (a.to("dipu") @ b.to("dipu")).cpu()
    ditorch.set_chip("D")  # TF32 inputs and a narrow accumulator: not the host's result
    chip = (a.to("dipu") @ b.to("dipu")).cpu()
    torch.testing.assert_close(host, a @ b)
    assert not torch.equal(chip, host)
