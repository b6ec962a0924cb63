"""Each chip's arithmetic against a hand-written reference: blocked, narrow accumulation of
matmuls, truncating narrowing, reduced-precision special functions; and in bf16 mixed precision
the chips are distinct numeric machines, while the reference chip equals the host."""
import math

import pytest
import torch

import ditorch
from ditorch_ext import ChipProfile


def chip(**numerics) -> ChipProfile:
    return ChipProfile("T", memory_gb=8, relative_speed=2.0, chips_per_node=8, nics_per_node=8, **numerics)


def round_bits(x: float, bits: int, toward_zero: bool = False) -> float:
    """x rounded to `bits` mantissa bits (after the leading one), in float64 arithmetic."""
    if x == 0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    scaled = m * 2.0 ** (bits + 1)
    if toward_zero:
        q = math.trunc(scaled)
    else:
        q = math.floor(scaled)
        rest = scaled - q
        if rest > 0.5 or (rest == 0.5 and q % 2 == 1):
            q += 1
    return q * 2.0 ** (e - bits - 1)


def reference_matmul(a: torch.Tensor, b: torch.Tensor, acc_bits: int, block: int, out_bits: int,
                     toward_zero: bool) -> torch.Tensor:
    """The chip's mm element by element: exact block sums, the running sum truncated to acc_bits
    after each block, the result narrowed to out_bits."""
    a64, b64 = a.double().tolist(), b.double().tolist()
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    out = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        for j in range(n):
            total = None
            for k0 in range(0, k, block):
                part = math.fsum(a64[i][t] * b64[t][j] for t in range(k0, min(k0 + block, k)))
                total = round_bits(part if total is None else total + part, acc_bits, toward_zero=True)
            out[i, j] = round_bits(total, out_bits, toward_zero)
    return out


def small_integers(*shape: int, seed: int) -> torch.Tensor:
    """bf16-exact values whose products and block sums are exact in fp32: the kernel's fp32
    block sums then equal the reference's exact ones, and only the chip's rounding remains."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-31, 32, shape, generator=g).float() * 2.0 ** torch.randint(-3, 4, shape, generator=g)).bfloat16()


@pytest.mark.parametrize("acc_bits,block,toward_zero", [(4, 4, False), (6, 3, True), (23, 5, True), (9, 0, False)])
def test_matmul_accumulates_in_blocks_and_narrows_as_the_chip(acc_bits, block, toward_zero):
    a, b = small_integers(5, 13, seed=acc_bits), small_integers(13, 6, seed=block)
    ditorch.set_chip(chip(accumulator_bits=acc_bits, accumulation_block=block, round_toward_zero=toward_zero))
    got = (a.dipu() @ b.dipu()).cpu()
    assert got.dtype == torch.bfloat16
    want = reference_matmul(a, b, acc_bits, block or 13, 7, toward_zero)
    assert torch.equal(got.double(), want)
    host = (a.float() @ b.float()).bfloat16()
    assert acc_bits == 23 and not toward_zero or not torch.equal(got, host)  # the chip is visible


def test_addmm_and_bmm_follow_the_same_accumulator():
    ditorch.set_chip(chip(accumulator_bits=5, accumulation_block=4))
    a, b, bias = small_integers(3, 9, seed=1), small_integers(9, 4, seed=2), small_integers(4, seed=3)
    got = torch.addmm(bias.dipu(), a.dipu(), b.dipu(), beta=1, alpha=1).cpu()
    want = reference_matmul(a, b, 5, 4, 52, False) + bias.double()
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=0, atol=0)
    batch_a, batch_b = torch.stack([a, -a]), torch.stack([b, b])
    got = torch.bmm(batch_a.dipu(), batch_b.dipu()).cpu()
    for i in range(2):
        assert torch.equal(got[i].double(), reference_matmul(batch_a[i], batch_b[i], 5, 4, 7, False))


@pytest.mark.parametrize("call", [
    lambda: torch.mm(torch.ones(2, 3), torch.ones(4, 5)),
    lambda: torch.bmm(torch.ones(2, 2, 3), torch.ones(3, 3, 2)),
    lambda: torch.addmm(torch.ones(3), torch.ones(2, 3), torch.ones(3, 4)),
    lambda: torch.mm(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float64)),
], ids=["mm", "bmm", "addmm bias", "mm dtypes"])
def test_a_matmul_the_chip_computes_alone_refuses_what_the_kernel_refuses(call):
    """The chip's accumulation replaces the kernel only for a valid call: a bad one reaches the
    kernel and fails as it does on the CPU."""
    with pytest.raises(RuntimeError) as on_cpu:
        call()
    ditorch.set_chip(chip(accumulator_bits=5, accumulation_block=4))
    with torch.device("dipu"), pytest.raises(RuntimeError) as on_chip:
        call()
    assert str(on_chip.value).splitlines()[0] == str(on_cpu.value).splitlines()[0]


def test_casts_to_bf16_and_fp16_truncate_on_a_truncating_chip():
    x = torch.randn(4096) * 100
    ditorch.set_chip(chip(round_toward_zero=True))
    got = x.dipu().to(torch.bfloat16).cpu()
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)  # bf16 is fp32's top half
    assert torch.equal(got.float(), truncated)
    half = x.dipu().half().cpu()
    assert torch.equal(half.double(), torch.tensor([round_bits(v, 10, True) for v in x.tolist()], dtype=torch.float64))
    ditorch.set_chip("host")
    assert torch.equal(x.dipu().to(torch.bfloat16).cpu(), x.to(torch.bfloat16))  # nearest-even


def test_special_functions_carry_the_chips_bits():
    x = torch.randn(512)
    ditorch.set_chip(chip(special_function_bits=8))
    for fn in (torch.exp, torch.sigmoid, torch.rsqrt, lambda t: torch.softmax(t, 0)):
        got = fn(x.abs().dipu() + 0.1).cpu()
        exact = fn(x.abs() + 0.1)
        assert torch.equal(got.double(), torch.tensor([round_bits(v, 8, True) for v in exact.tolist()], dtype=torch.float64))
    ditorch.set_chip(chip(special_function_bits=10, round_toward_zero=True))
    xb = x.bfloat16()
    got = torch.nn.functional.silu(xb.dipu()).cpu()
    exact = torch.nn.functional.silu(xb.float())
    want = [round_bits(round_bits(v, 10, True), 7, True) for v in exact.tolist()]
    assert torch.equal(got.double(), torch.tensor(want, dtype=torch.float64))


def _bf16_loss(chip_name: str) -> float:
    from dimodel import Llama, LlamaConfig

    ditorch.set_chip(chip_name)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                              max_seq_len=32)).dipu()
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1)).dipu()
    with torch.autocast("dipu", dtype=torch.bfloat16):
        loss = model.loss(tokens)
    loss.backward()
    grad = sum(float(p.grad.float().abs().sum()) for p in model.parameters())
    return float(loss.detach()), grad


def test_in_bf16_mixed_precision_each_chip_is_its_own_numeric_machine():
    results = {name: _bf16_loss(name) for name in ("A100", "A", "B", "C", "D")}
    assert len(set(results.values())) == len(results), results
    # The reference chip is the host's arithmetic: the same run on the un-emulated host chip.
    assert results["A100"] == _bf16_loss("host")
