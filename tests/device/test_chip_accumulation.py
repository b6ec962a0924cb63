"""The chip's K-reduction kernel (torch.ops.ditorch_emu.chip_matmul: what an emulated chip's mm,
addmm, bmm and baddbmm run) against a reference written here in numpy: the products of each block
of K-terms summed in float64, the running sum truncated bit-wise to the accumulator's mantissa
after every block. Inputs of small integers times powers of two make every fp32 sum exact, so the
kernel must match bit for bit whatever order it sums a block in; normal inputs are checked within
the rounding a block's fp32 sum may differ by."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import ditorch_ext  # noqa: F401  (registers torch.ops.ditorch_emu)
from diutil.datasheets.chips import resolve

chip_matmul = torch.ops.ditorch_emu.chip_matmul

# (accumulator_bits, accumulation_block) of the built-in chips with a narrow accumulator.
PROFILES = {name: (resolve(name).accumulator_bits, resolve(name).accumulation_block) for name in ("B", "C", "D")}


def truncate(total: np.ndarray, bits: int) -> np.ndarray:
    """float64 `total` as fp32 with its mantissa truncated to `bits` bits; inf and NaN kept."""
    u = total.astype(np.float32).view(np.uint32)
    mask = np.uint32((0xFFFFFFFF << (23 - bits)) & 0xFFFFFFFF) if bits < 23 else np.uint32(0xFFFFFFFF)
    special = (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return np.where(special, u, u & mask).view(np.float32).astype(np.float64)


def reference(a: torch.Tensor, b: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """a [..., m, k] @ b [..., k, n] as the chip sums it: float64 block sums of explicit products
    (no BLAS, so inf * 0 is NaN as in IEEE arithmetic), truncation after every block."""
    a64, b64 = a.double().numpy(), b.double().numpy()
    k = a64.shape[-1]
    block = min(block, k) if block > 0 else k
    total = np.zeros(a64.shape[:-1] + b64.shape[-1:])
    with np.errstate(invalid="ignore", over="ignore"):
        for k0 in range(0, k, block):
            part = (a64[..., :, k0:k0 + block, None] * b64[..., None, k0:k0 + block, :]).sum(axis=-2)
            total = truncate(total + part if k0 else part, bits)
    return torch.from_numpy(total.astype(np.float32))


def exact_operand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Integers in [-8, 8] times 2**[-2, 2]: exact in bf16 and fp16, and every sum of up to a few
    hundred of their products exact in fp32 (22 significant bits at most)."""
    ints = torch.randint(-8, 9, shape, generator=g).double()
    return (ints * 2.0 ** torch.randint(-2, 3, shape, generator=g)).to(dtype)


def layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same matrix (the last two dims) contiguous, as a transposed view, or as a strided slice."""
    if how == "transposed":  # how weights arrive: W [n, k] viewed as W.t()
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "strided":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


def random_cases(seed: int, count: int):
    """Shapes from 1x1x1 to several tiles each way, K both below and above the block and not a
    multiple of it, batched or not, every operand layout and input dtype."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    layouts = ["contiguous", "transposed", "strided"]
    for i in range(count):
        m, n = (int(v) for v in rng.integers(1, 70, size=2))
        k = int(rng.integers(1, 200))
        batch = () if i % 3 else (int(rng.integers(1, 4)),)
        dtype = dtypes[i % len(dtypes)]
        a = layout(exact_operand(batch + (m, k), dtype, g), layouts[i % 3])
        b = layout(exact_operand(batch + (k, n), dtype, g), layouts[(i // 3) % 3])
        yield a, b


@pytest.mark.parametrize("bits,block", [*PROFILES.values(), (0, 5), (3, 1), (23, 7), (9, 0), (12, 1000)],
                         ids=[*PROFILES, "0-bits", "block-1", "fp32-accumulator", "all-of-K", "block-beyond-K"])
def test_matches_the_reference_bit_for_bit(bits, block):
    for a, b in random_cases(seed=bits * 1000 + block, count=24):
        got = chip_matmul(a, b, bits, block)
        want = reference(a, b, bits, block)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want), (bits, block, a.shape, a.stride(), b.shape, b.stride(), a.dtype,
                                        (got - want).abs().max())


def test_tiny_and_empty_products():
    one = torch.tensor([[3.0]]).bfloat16()
    assert torch.equal(chip_matmul(one, one, 12, 32), torch.tensor([[9.0]]))
    assert torch.equal(chip_matmul(torch.ones(2, 0), torch.ones(0, 3), 12, 32), torch.zeros(2, 3))
    assert chip_matmul(torch.ones(0, 4), torch.ones(4, 3), 12, 32).shape == (0, 3)
    assert chip_matmul(torch.ones(2, 0, 4), torch.ones(2, 4, 5), 12, 32).shape == (2, 0, 5)


@pytest.mark.parametrize("chip", sorted(PROFILES))
def test_normal_inputs_within_a_blocks_rounding(chip):
    """Inputs as training makes them (normal, several magnitudes): the kernel's fp32 block sums may
    differ from exact ones, and a truncation may then fall one accumulator unit apart per block;
    every result keeps only the accumulator's bits."""
    bits, block = PROFILES[chip]
    g = torch.Generator().manual_seed(len(chip))
    for m, k, n in [(64, 512, 96), (17, 1408, 40), (128, 128, 33)]:
        a = (torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-2, 3, (m, 1), generator=g)).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        got = chip_matmul(a, w.t(), bits, block).double()
        want = reference(a, w.t(), bits, block).double()
        magnitude = a.double().abs() @ w.t().double().abs()
        blocks = -(-k // block)
        tolerance = magnitude * blocks * (2.0 ** (1 - bits) + block * 2.0 ** -23)
        assert ((got - want).abs() <= tolerance).all(), (chip, m, k, n)
        low = got.float().view(torch.int32) & ((1 << (23 - bits)) - 1)
        assert (low == 0).all(), f"{chip}: results carry more than the accumulator's {bits} bits"


@pytest.mark.parametrize("bits", [0, 12])
def test_nan_and_inf_pass_through(bits):
    g = torch.Generator().manual_seed(bits)
    a, b = exact_operand((9, 40), torch.float32, g), exact_operand((40, 35), torch.float32, g)
    a[0, 3], a[1, 5], a[2, 7], b[7, 2], b[30, 34] = float("nan"), float("inf"), float("inf"), float("-inf"), 0.0
    a[2, 30] = float("inf")  # inf * 0 in row 2, column 34
    got, want = chip_matmul(a, b, bits, 16), reference(a, b, bits, 16)
    assert torch.isnan(got[0]).all() and torch.isinf(got[1]).any() and torch.isnan(got[2, 34])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_bad_arguments_are_refused_with_their_values():
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    with pytest.raises(RuntimeError, match="accumulator_bits=24"):
        chip_matmul(a, b, 24, 32)
    with pytest.raises(RuntimeError, match="accumulation_block=-1"):
        chip_matmul(a, b, 12, -1)
    with pytest.raises(RuntimeError, match=r"\[2, 3\] and \[4, 4\]"):
        chip_matmul(a, torch.ones(4, 4), 12, 32)
    with pytest.raises(RuntimeError, match="floating types"):
        chip_matmul(a.int(), b.int(), 12, 32)


_OTHER_KERNEL = """
import sys, torch, ditorch_ext
cases = torch.load(sys.argv[1])
out = [torch.ops.ditorch_emu.chip_matmul(a, b, bits, block) for a, b, bits, block in cases]
torch.save({"kernel": torch.ops.ditorch_emu.chip_matmul_kernel(), "out": out}, sys.argv[2])
"""


@pytest.mark.parametrize("capability,kernel", [("avx2", "avx2"), ("default", "scalar")])
def test_each_instruction_set_matches_the_reference(capability, kernel, tmp_path):
    """The kernel follows ATen's choice of instruction set (ATEN_CPU_CAPABILITY, as
    scripts/slow_host.sh sets it for a host with AVX2 only), and each one sums as the chip does."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"this host's CPU capability is {torch.backends.cpu.get_cpu_capability()}, without AVX2")
    cases = [(a, b, bits, block) for (bits, block), seed in zip(PROFILES.values(), (1, 2, 3))
             for a, b in random_cases(seed, 6)]
    torch.save(cases, tmp_path / "cases.pt")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    subprocess.run([sys.executable, "-c", _OTHER_KERNEL, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, timeout=120)
    result = torch.load(tmp_path / "out.pt")
    assert result["kernel"] == kernel
    for (a, b, bits, block), got in zip(cases, result["out"]):
        assert torch.equal(got, reference(a, b, bits, block)), (capability, bits, block, a.shape, b.shape)
