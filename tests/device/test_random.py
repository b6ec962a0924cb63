"""dipu's counter-based random numbers (csrc/device/Generator.h, CounterRandom.h).

The state is (seed, offset), 16 bytes, as DTensor's RNG tracker reads it; element i of an op
drawn at offset o takes the Philox4x32-10 block of (seed, o + i). The reference here is Philox
written again in Python and checked against the Random123 known-answer vectors, so the values
are checked against an implementation that shares no code with the one under test. The
sharding invariance this gives DTensor is tested on 4 ranks in tests/comm/test_dtensor_random.py.
"""
from __future__ import annotations

import math
import struct

import pytest
import torch

import ditorch

pytestmark = pytest.mark.skipif(ditorch.vendor_name() not in ("emu", "cpu"),
                                reason="a vendor with its own kernel device keeps its own generator")

_MASK = 0xFFFFFFFF


def philox(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., SC'11), from the paper's definition."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK, p1 & _MASK, ((p0 >> 32) ^ c3 ^ k1) & _MASK, p0 & _MASK
        k0, k1 = (k0 + 0x9E3779B9) & _MASK, (k1 + 0xBB67AE85) & _MASK
    return c0, c1, c2, c3


def test_the_reference_philox_gives_random123s_known_answers():
    assert philox((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox((_MASK,) * 4, (_MASK, _MASK)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def block(seed: int, counter: int) -> tuple[int, int, int, int]:
    return philox((counter & _MASK, counter >> 32, 0, 0), (seed & _MASK, seed >> 32))


def expected_rand(seed: int, offset: int, n: int) -> torch.Tensor:
    """torch.rand(n) in float32: 24 bits of words 0-1 of element i's block, over 2^24."""
    values = []
    for i in range(n):
        w = block(seed, offset + i)
        values.append(((w[0] << 32 | w[1]) >> 40) / 2 ** 24)
    return torch.tensor(values, dtype=torch.float32)


def expected_randn(seed: int, offset: int, n: int) -> torch.Tensor:
    """torch.randn(n): Box-Muller on 53-bit uniforms from words 0-1 and 2-3."""
    values = []
    for i in range(n):
        w = block(seed, offset + i)
        u1 = 1.0 - ((w[0] << 32 | w[1]) >> 11) / 2 ** 53
        u2 = ((w[2] << 32 | w[3]) >> 11) / 2 ** 53
        values.append(math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2))
    return torch.tensor(values, dtype=torch.float64).float()


def state_of(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor(list(struct.pack("<QQ", seed, offset)), dtype=torch.uint8)


def test_the_state_is_seed_and_offset_and_ops_advance_it_by_multiples_of_4():
    torch.manual_seed(1234)
    state = torch.dipu.get_rng_state()
    assert state.dtype == torch.uint8 and state.numel() == 16
    assert struct.unpack("<QQ", bytes(state.tolist())) == (1234, 0)
    torch.rand(10, device="dipu")
    torch.randn(3, 4, device="dipu")
    assert struct.unpack("<QQ", bytes(torch.dipu.get_rng_state().tolist())) == (1234, 12 + 12)
    assert torch.dipu.initial_seed() == 1234


def test_values_are_philox_of_seed_and_offset_plus_index():
    torch.dipu.set_rng_state(state_of(2 ** 40 + 7, 2 ** 33 - 8))  # both words of the key and counter used
    torch.testing.assert_close(torch.rand(37, device="dipu").cpu(), expected_rand(2 ** 40 + 7, 2 ** 33 - 8, 37),
                               rtol=0, atol=0)
    torch.dipu.set_rng_state(state_of(99, 4))
    torch.testing.assert_close(torch.randn(2, 19, device="dipu").cpu().flatten(), expected_randn(99, 4, 38),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("draw", [
    lambda t: t.uniform_(-2, 3), lambda t: t.normal_(1, 2), lambda t: t.bernoulli_(0.3),
    lambda t: t.random_(0, 1000), lambda t: t.exponential_(2.0), lambda t: t.geometric_(0.25),
    lambda t: t.log_normal_(0, 0.5), lambda t: t.cauchy_(0, 1), lambda t: t.bernoulli_(torch.full_like(t, 0.6)),
], ids=["uniform", "normal", "bernoulli", "random", "exponential", "geometric", "log_normal", "cauchy", "bernoulli_tensor"])
def test_a_run_started_at_a_later_offset_is_the_tail_of_the_full_draw(draw):
    """What makes DTensor's random ops sharding-invariant: the shard that starts at offset k
    holds the full tensor's elements from k on (k a multiple of 4), whatever the dtype's layout."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        torch.dipu.set_rng_state(state_of(5, 100))
        full = draw(torch.empty(16, 4, device="dipu", dtype=dtype)).cpu()
        torch.dipu.set_rng_state(state_of(5, 100 + 24))
        tail = draw(torch.empty(10, 4, device="dipu", dtype=dtype)).cpu()
        assert torch.equal(tail, full[6:]), (dtype, tail, full[6:])
    # a transposed (non-contiguous) tensor is filled in its own row-major order
    torch.dipu.set_rng_state(state_of(5, 0))
    viewed = draw(torch.empty(4, 16, device="dipu").t()).cpu()
    torch.dipu.set_rng_state(state_of(5, 0))
    assert torch.equal(viewed, draw(torch.empty(16, 4, device="dipu")).cpu())


def test_distributions_have_their_moments():
    torch.manual_seed(3)
    n = 200_000
    u = torch.empty(n, device="dipu").uniform_(-1, 3).cpu()
    assert u.min() >= -1 and u.max() < 3 and abs(u.mean() - 1) < 0.02
    z = torch.randn(n, device="dipu").cpu()
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    b = torch.empty(n, device="dipu").bernoulli_(0.3).cpu()
    assert set(b.unique().tolist()) == {0.0, 1.0} and abs(b.mean() - 0.3) < 0.005
    r = torch.randint(-5, 5, (n,), device="dipu").cpu()
    assert r.min() == -5 and r.max() == 4 and abs(r.float().mean() + 0.5) < 0.03
    e = torch.empty(n, device="dipu").exponential_(4.0).cpu()
    assert e.min() >= 0 and abs(e.mean() - 0.25) < 0.005
    g = torch.empty(n, device="dipu").geometric_(0.5).cpu()
    assert g.min() >= 1 and abs(g.mean() - 2) < 0.02
    c = torch.randn(n, dtype=torch.complex64, device="dipu").cpu()  # each part with half the variance
    assert abs(c.real.std() - 0.5 ** 0.5) < 0.01 and abs(c.imag.std() - 0.5 ** 0.5) < 0.01
    bits = torch.empty(n, dtype=torch.uint8, device="dipu").random_().cpu()
    assert bits.min() == 0 and bits.max() == 255
    mask = torch.nn.functional.dropout(torch.ones(n, device="dipu"), 0.25).cpu()
    kept = mask[mask != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.75))
    assert abs((mask == 0).float().mean() - 0.25) < 0.005


def test_seeds_generators_fork_rng_and_checkpoints_reproduce():
    torch.manual_seed(11)
    a = torch.randn(50, device="dipu").cpu()
    torch.randn(1000)  # the CPU generator is another one
    torch.manual_seed(11)
    assert torch.equal(torch.randn(50, device="dipu").cpu(), a)
    # a checkpoint of the state resumes the stream
    saved = torch.dipu.get_rng_state().clone()
    after = [torch.rand(7, device="dipu").cpu() for _ in range(3)]
    torch.dipu.set_rng_state(saved)
    assert all(torch.equal(torch.rand(7, device="dipu").cpu(), x) for x in after)
    # fork_rng restores the dipu state on leaving
    before = torch.dipu.get_rng_state()
    with torch.random.fork_rng(devices=[0], device_type="dipu"):
        torch.rand(100, device="dipu")
    assert torch.equal(torch.dipu.get_rng_state(), before)
    # Generator objects: their own streams, cloned states, seeds
    g = torch.Generator(device="dipu").manual_seed(3)
    assert g.get_state().numel() == 16
    x = torch.randn(5, device="dipu", generator=g).cpu()
    g2 = torch.Generator(device="dipu")
    g2.set_state(torch.Generator(device="dipu").manual_seed(3).get_state())
    assert torch.equal(torch.randn(5, device="dipu", generator=g2).cpu(), x)
    assert torch.equal(torch.dipu.get_rng_state(), before)  # a generator of its own moved nothing else
    # ops drawn through the kernel device's generator (randperm) are reproducible from the state too
    torch.manual_seed(4)
    p = torch.randperm(30, device="dipu").cpu()
    torch.manual_seed(4)
    assert torch.equal(torch.randperm(30, device="dipu").cpu(), p) and sorted(p.tolist()) == list(range(30))


def test_a_state_of_the_wrong_size_is_refused_naming_it():
    with pytest.raises(RuntimeError, match="expected 16 bytes .* got 5056 bytes"):
        torch.dipu.set_rng_state(torch.zeros(5056, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="expected 16 bytes .* got 8 bytes"):
        torch.Generator(device="dipu").set_state(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="torch.uint8"):
        torch.dipu.set_rng_state(torch.zeros(16, dtype=torch.int64))
