"""The wire codecs against a reference written here from their definition (NumPy FP32 per block,
bytes packed with ``struct``), over every length across three blocks and broad value generators,
and every way a payload can fail to fit its unit."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from dips.codec import BLOCK, Codec

QMAX = {"int8": 127, "int4": 7}


def generators(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Values as real pseudo-gradients and residuals come: normal, heavy-tailed, spanning many
    magnitudes, with zero blocks, denormals and exact ties."""
    out = {
        "normal": rng.standard_normal(n),
        "cauchy": rng.standard_cauchy(n),
        "magnitudes": rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n),
        "tiny": rng.standard_normal(n) * 1e-40,
        "ties": rng.integers(-3, 4, n).astype(np.float64),
    }
    z = rng.standard_normal(n)
    z[: min(n, BLOCK)] = 0.0
    out["zero block"] = z
    return {k: v.astype(np.float32) for k, v in out.items()}


def ref_quantize(x: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scales, codes and decoded values by the definition: scale = block absmax / qmax (FP32),
    code = x / scale rounded half to even, decoded = code * scale."""
    scales, codes = [], []
    for b in range(0, len(x), BLOCK):
        blk = x[b: b + BLOCK]
        s = np.float32(np.abs(blk).max()) / np.float32(qmax)
        scales.append(s)
        codes += [0 if s == 0 else int(np.clip(np.rint(v / s), -qmax, qmax)) for v in blk]
    dec = np.array([np.float32(c) * scales[i // BLOCK] for i, c in enumerate(codes)], dtype=np.float32)
    return np.array(scales, dtype=np.float32), np.array(codes), dec


def ref_payload(kind: str, x: np.ndarray, density: float = 0.0) -> tuple[bytes, np.ndarray]:
    if kind == "int8":
        s, c, dec = ref_quantize(x, 127)
        return struct.pack(f"<{len(s)}f{len(c)}b", *s, *c), dec
    if kind == "int4":
        s, c, dec = ref_quantize(x, 7)
        nib = [v + 8 for v in c] + ([0] if len(c) % 2 else [])
        return struct.pack(f"<{len(s)}f", *s) + bytes(nib[i] | nib[i + 1] << 4 for i in range(0, len(nib), 2)), dec
    n = len(x)
    k = min(n, max(1, math.ceil(density * n)))
    order = sorted(range(n), key=lambda i: -abs(float(x[i])))
    idx = sorted(order[:k])
    s, c, dec_vals = ref_quantize(x[idx], 127)
    dec = np.zeros(n, dtype=np.float32)
    dec[idx] = dec_vals
    return struct.pack(f"<{k}i{len(s)}f{k}b", *idx, *s, *c), dec


@pytest.mark.parametrize("kind", ["int8", "int4", "topk:0.01", "topk:0.1", "topk:0.25"])
def test_round_trip_matches_the_reference_for_every_length(kind):
    codec = Codec.parse(kind)
    rng = np.random.default_rng(7)
    for n in range(1, 3 * BLOCK + 2):
        for name, x in generators(n, rng).items():
            if codec.kind == "topk" and name in ("ties", "zero block"):
                continue  # which of equal magnitudes top-k keeps is not defined
            payload, dec = codec.round_trip(torch.from_numpy(x))
            want_payload, want_dec = ref_payload(codec.kind, x, codec.density)
            assert len(payload) == codec.payload_bytes(n), (kind, n, name)
            assert payload == want_payload, (kind, n, name)
            np.testing.assert_array_equal(dec.numpy(), want_dec, err_msg=f"{kind} n={n} {name}")
            np.testing.assert_array_equal(codec.decode(payload, n).numpy(), want_dec)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_error_is_at_most_half_a_step(kind):
    codec, qmax = Codec.parse(kind), QMAX[kind]
    x = torch.randn(10_000) * torch.logspace(-3, 3, 10_000)
    dec = codec.round_trip(x)[1]
    step = torch.cat([b.abs().amax().expand(len(b)) for b in x.split(BLOCK)]) / qmax
    assert bool(((x - dec).abs() <= step / 2 * (1 + 1e-6)).all())


def test_bf16_round_trip_is_torch_bf16():
    x = torch.randn(1000) * 1e3
    payload, dec = Codec.parse("bf16").round_trip(x)
    assert torch.equal(dec, x.to(torch.bfloat16).float()) and len(payload) == 2000


def test_topk_keeps_the_largest_magnitudes():
    g = torch.Generator().manual_seed(3)
    x = (torch.randperm(1000, generator=g).float() + 1) * (torch.randint(0, 2, (1000,), generator=g) * 2 - 1)
    codec = Codec.parse("topk:0.03")
    dec = codec.round_trip(x)[1]
    kept = set(dec.nonzero().flatten().tolist())
    want = set(sorted(range(1000), key=lambda i: -abs(float(x[i])))[:30])
    assert kept == want


def test_every_int8_and_int4_code_decodes_or_is_refused():
    scale = struct.pack("<f", 0.5)
    for code in range(-128, 128):
        payload = scale + struct.pack("<b", code)
        if code == -128:
            with pytest.raises(ValueError, match="code -128"):
                Codec.parse("int8").decode(payload, 1)
        else:
            assert Codec.parse("int8").decode(payload, 1).item() == code * 0.5
    for byte in range(256):  # two 4-bit codes
        lo, hi = byte & 15, byte >> 4
        payload = scale + bytes([byte])
        if 0 in (lo, hi):
            with pytest.raises(ValueError, match="code -8"):
                Codec.parse("int4").decode(payload, 2)
        else:
            assert Codec.parse("int4").decode(payload, 2).tolist() == [(lo - 8) * 0.5, (hi - 8) * 0.5]
        # one code: the high nibble is padding and must be 0
        if hi != 0:
            with pytest.raises(ValueError, match="padding nibble"):
                Codec.parse("int4").decode(payload, 1)


def _bad(codec: str, payload: bytes, n: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Codec.parse(codec).decode(payload, n, what="unit layers.0")


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4", "topk:0.1"])
def test_a_payload_of_the_wrong_length_is_refused(codec):
    good = Codec.parse(codec).encode(torch.randn(300))
    _bad(codec, good[:-1], 300, "unit layers.0: .* bytes .* expected")
    _bad(codec, good + b"\0", 300, "expected")
    _bad(codec, good, 301 if codec != "topk:0.1" else 320, "expected")


@pytest.mark.parametrize("codec", ["int8", "int4", "topk:0.1"])
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, -1.0])
def test_a_bad_scale_is_refused(codec, scale):
    n = 1300  # top-k keeps 130: three blocks
    good = bytearray(Codec.parse(codec).encode(torch.randn(n)))
    at = 4 * Codec.parse(codec).kept(n) if codec.startswith("topk") else 0
    good[at + 4: at + 8] = struct.pack("<f", scale)  # the second block's scale
    _bad(codec, bytes(good), n, "scale .* of block 1")


def test_a_scale_that_overflows_is_refused():
    payload = struct.pack("<f", 3e38) + struct.pack("<b", 100)
    _bad("int8", payload, 1, "non-finite")


@pytest.mark.parametrize("index,match", [(300, "index 300 out of range"), (-1, "index -1 out of range"),
                                         (2 ** 31 - 1, "out of range"), ("dup", "strictly increasing"),
                                         ("swap", "strictly increasing")])
def test_a_bad_topk_index_is_refused(index, match):
    codec = Codec.parse("topk:0.1")
    good = bytearray(codec.encode(torch.randn(300)))
    k = codec.kept(300)
    idx = list(struct.unpack(f"<{k}i", good[: 4 * k]))
    if index == "dup":
        idx[1] = idx[0]
    elif index == "swap":
        idx[0], idx[1] = idx[1], idx[0]
    else:
        idx[-1] = index
    good[: 4 * k] = struct.pack(f"<{k}i", *idx)
    _bad("topk:0.1", bytes(good), 300, match)


@pytest.mark.parametrize("spec", ["", "int16", "topk:0", "topk:0.3", "topk:1", "topk:nan", "topk:x", "int8:3", "bf16:1",
                                  "topk:" + "1" * 40, None, 8])
def test_bad_specs_are_refused_by_name(spec):
    with pytest.raises(ValueError, match="codec"):
        Codec.parse(spec)


def test_specs_round_trip_and_sizes():
    assert [str(Codec.parse(s)) for s in ("bf16", "int8", "int4", "topk", "topk:0.01")] == \
        ["bf16", "int8", "int4", "topk:0.02", "topk:0.01"]
    n = 64_000
    assert Codec.parse("bf16").payload_bytes(n) == 128_000
    assert Codec.parse("int8").payload_bytes(n) == 64_000 + 4_000
    assert Codec.parse("int4").payload_bytes(n) == 32_000 + 4_000
    assert Codec.parse("topk:0.01").payload_bytes(n) == 640 * 4 + 10 * 4 + 640


def test_non_finite_values_are_not_encoded():
    with pytest.raises(ValueError, match="non-finite"):
        Codec.parse("int8").encode(torch.tensor([1.0, math.nan]))
