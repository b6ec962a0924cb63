"""SparseLoCo's push (``sparseloco:D``: per chunk of 4096 values its top-k, a sign and one of two
magnitudes each) and the exact sparse pull (``nonzero``: a difference's nonzero entries in FP32),
against references written here from their definitions (Python floats, exact sums, bytes packed
with ``struct``), over lengths around every chunk boundary and broad value generators, and every
way a payload can fail to fit its unit."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from dips.codec import CHUNK, DECAY, Codec

from test_codec import generators
from test_codec_sparse_sign import SPARSE_LENGTHS


def ref_sparseloco(x: np.ndarray, density: float) -> tuple[bytes, np.ndarray]:
    """Per chunk: its k = ceil(density * size) largest magnitudes (at least 1), indices
    increasing; magnitudes split at t = (min + max) / 2, the low level the mean of those below t,
    the high level the mean of those at or above (a side with none takes the other's); code =
    (1 if >= 0) + (2 if high). Layout: (low, high) per chunk, 16-bit indices, codes 4 a byte."""
    levels, idx_all, codes = [], [], []
    dec = np.zeros(len(x), dtype=np.float32)
    for start in range(0, len(x), CHUNK):
        chunk = x[start: start + CHUNK]
        k = min(len(chunk), max(1, math.ceil(density * len(chunk))))
        idx = sorted(sorted(range(len(chunk)), key=lambda i: -abs(float(chunk[i])))[:k])
        mags = [abs(float(chunk[i])) for i in idx]
        t = (min(mags) + max(mags)) / 2
        high = [m >= t for m in mags]
        his = [m for m, h in zip(mags, high) if h]
        los = [m for m, h in zip(mags, high) if not h]
        hi = math.fsum(his) / len(his) if his else math.fsum(los) / len(los)
        lo = math.fsum(los) / len(los) if los else hi
        lo32, hi32 = np.float32(lo), np.float32(hi)
        levels += [lo32, hi32]
        for i, h in zip(idx, high):
            positive = float(chunk[i]) >= 0
            codes.append(int(positive) + 2 * int(h))
            dec[start + i] = (hi32 if h else lo32) * (1 if positive else -1)
        idx_all += idx
    packed = codes + [0] * (-len(codes) % 4)
    code_bytes = bytes(sum(packed[i + j] << (2 * j) for j in range(4)) for i in range(0, len(packed), 4))
    return struct.pack(f"<{len(levels)}f{len(idx_all)}H", *levels, *idx_all) + code_bytes, dec


def ref_nonzero(x: np.ndarray) -> bytes:
    """Each chunk's count of nonzero values (uint32), then those values (FP32), then their
    indices within their chunk (uint16), all in order."""
    counts, values, idx = [], [], []
    for start in range(0, len(x), CHUNK):
        chunk = x[start: start + CHUNK]
        at = [i for i in range(len(chunk)) if chunk[i] != 0]
        counts.append(len(at))
        values += [float(chunk[i]) for i in at]
        idx += at
    return struct.pack(f"<{len(counts)}I{len(values)}f{len(idx)}H", *counts, *values, *idx)


@pytest.mark.parametrize("spec", ["sparseloco:0.01", "sparseloco:0.03", "sparseloco:0.25"])
def test_sparseloco_round_trip_matches_the_reference(spec):
    codec = Codec.parse(spec)
    rng = np.random.default_rng(17)
    for n in SPARSE_LENGTHS:
        for name, x in generators(n, rng).items():
            if name in ("ties", "zero block", "tiny"):
                continue  # which equal magnitudes top-k keeps is not defined; denormal means round apart
            payload, dec = codec.round_trip(torch.from_numpy(x))
            want_payload, want_dec = ref_sparseloco(x, codec.density)
            assert len(payload) == codec.payload_bytes(n) == len(want_payload), (spec, n, name)
            m = 2 * math.ceil(n / CHUNK)
            np.testing.assert_allclose(np.frombuffer(payload[:4 * m], "<f4"),
                                       np.frombuffer(want_payload[:4 * m], "<f4"), rtol=1e-6, err_msg=f"{spec} n={n} {name}")
            assert payload[4 * m:] == want_payload[4 * m:], (spec, n, name)  # indices and codes exactly
            np.testing.assert_allclose(dec.numpy(), want_dec, rtol=1e-6, err_msg=f"{spec} n={n} {name}")
            assert torch.equal(codec.decode(payload, n), dec)


def test_sparseloco_levels_by_hand():
    """One chunk of 16, density 0.25: the top 4 are 8, -6, 2, -1 (kept in index order); t = 4.5,
    so the high level is (8 + 6) / 2 = 7 and the low one (2 + 1) / 2 = 1.5."""
    x = torch.tensor([8.0, 0.5, -6.0, 0.25, 2.0, -1.0, 0.0, 0.75] + [0.125] * 8)
    payload, dec = Codec.parse("sparseloco:0.25").round_trip(x)
    assert dec.tolist() == [7.0, 0.0, -7.0, 0.0, 1.5, -1.5] + [0.0] * 10
    lo, hi, *idx = struct.unpack("<2f4H", payload[:16])
    assert (lo, hi, idx) == (1.5, 7.0, [0, 2, 4, 5])
    # codes 3 (+, high), 2 (-, high), 1 (+, low), 0 (-, low), the first in the lowest bits
    assert payload[16:] == bytes([3 | 2 << 2 | 1 << 4 | 0 << 6])


def test_sparseloco_error_feedback_with_decay_by_hand():
    """Three pushes of one chunk of 4 at density 0.25 (one value each), e <- 0.95 e + g, send
    top-1 of e, e <- e - sent, worked by hand: g1 = [4, -1, 0.5, 2] sends 4 and keeps
    [0, -1, 0.5, 2]; g2 = 0 makes e = [0, -0.95, 0.475, 1.9] and sends 1.9; g3 = [1, 0, 0, 0]
    makes e = [1, -0.9025, 0.45125, 0] and sends the 1 (the decayed -0.9025 is smaller)."""
    codec = Codec.parse("sparseloco:0.25")
    assert codec.decay == DECAY == 0.95
    e = torch.zeros(4)
    sent = []
    for g in ([4.0, -1.0, 0.5, 2.0], [0.0] * 4, [1.0, 0.0, 0.0, 0.0]):
        e = e * codec.decay + torch.tensor(g)
        dec = codec.round_trip(e)[1]
        sent.append(dec.tolist())
        e = e - dec
    assert sent == [[4.0, 0, 0, 0], [0, 0, 0, pytest.approx(1.9)], [1.0, 0, 0, 0]]
    torch.testing.assert_close(e, torch.tensor([0.0, -0.9025, 0.45125, 0.0]))


@pytest.mark.parametrize("density", [0.0, 1e-4, 0.03, 0.5, 1.0])
def test_nonzero_carries_a_difference_exactly(density):
    rng = np.random.default_rng(19)
    codec = Codec.parse("nonzero")
    for n in SPARSE_LENGTHS:
        for name, x in generators(n, rng).items():
            x = np.where(rng.random(n) < density, x, 0).astype(np.float32)
            payload, dec = codec.round_trip(torch.from_numpy(x))
            assert payload == ref_nonzero(x), (n, name)
            assert len(payload) == codec.payload_bytes(n, int((x != 0).sum()))
            np.testing.assert_array_equal(dec.numpy(), x)  # bit for bit (0 and -0 alike)
            assert torch.equal(codec.decode(payload, n), dec)


def _bad(codec: str, payload: bytes, n: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Codec.parse(codec).decode(payload, n, what="unit layers.0")


def test_a_sparseloco_payload_that_does_not_fit_is_refused():
    n = 2 * CHUNK + 808
    spec = "sparseloco:0.03"
    codec = Codec.parse(spec)
    good = codec.encode(torch.randn(n))
    m, k = 3, codec.kept(n)
    _bad(spec, good[:-1], n, "bytes of sparseloco:0.03 for 9000 values; expected")
    _bad(spec, good + b"\0", n, "expected")
    _bad(spec, good, n + CHUNK, "expected")
    for at, value in [(0, math.nan), (4, math.inf), (12, -math.inf), (20, -1.0)]:  # low and high levels
        _bad(spec, good[:at] + struct.pack("<f", value) + good[at + 4:], n, f"scale .* of block {at // 4}")
    idx = list(struct.unpack(f"<{k}H", good[8 * m: 8 * m + 2 * k]))
    per = math.ceil(0.03 * CHUNK)

    def with_idx(new: list[int]) -> bytes:
        return good[:8 * m] + struct.pack(f"<{k}H", *new) + good[8 * m + 2 * k:]

    _bad(spec, with_idx(idx[:per - 1] + [CHUNK] + idx[per:]), n, "index 4096 of chunk 0 out of range 0..4095")
    _bad(spec, with_idx(idx[:-1] + [808]), n, "index 808 of chunk 2 out of range 0..807")
    _bad(spec, with_idx([idx[0]] + idx[:per - 1] + idx[per:]), n, "indices of chunk 0 are not strictly increasing")
    swapped = idx[:]
    swapped[per], swapped[per + 1] = swapped[per + 1], swapped[per]
    _bad(spec, with_idx(swapped), n, "indices of chunk 1 are not strictly increasing")
    if k % 4:  # a padding bit after the last code
        _bad(spec, good[:-1] + bytes([good[-1] | 0x80]), n, "padding bits after")


def test_a_nonzero_payload_that_does_not_fit_is_refused():
    n = 2 * CHUNK + 808
    x = torch.zeros(n)
    x[[3, 7, CHUNK + 1, 2 * CHUNK + 807]] = torch.tensor([1.0, -2.0, 3.0, 4.0])
    good = Codec.parse("nonzero").encode(x)
    assert struct.unpack("<3I", good[:12]) == (2, 1, 1)
    _bad("nonzero", good[:-1], n, "bytes of nonzero for 9000 values with 4 sent; expected 36")
    _bad("nonzero", good + b"\0" * 6, n, "expected 36")
    _bad("nonzero", good[:8], n, "expected at least 12")
    _bad("nonzero", struct.pack("<3I", 4097, 0, 0), n, "count 4097 of chunk 0; expected 0..4096")
    _bad("nonzero", struct.pack("<3I", 0, 0, 809), n, "count 809 of chunk 2; expected 0..808")
    _bad("nonzero", struct.pack("<3i", 0, -1, 0), n, "count -1 of chunk 1")
    # the values (FP32) start after the three counts, the indices after the four values
    for bad_value, words in [(math.nan, "value nan"), (math.inf, "value inf"), (-math.inf, "value -inf"),
                             (0.0, "value 0")]:
        _bad("nonzero", good[:16] + struct.pack("<f", bad_value) + good[20:], n, words)
    _bad("nonzero", good[:28] + struct.pack("<4H", 3, 7, 4096, 807), n, "index 4096 of chunk 1 out of range")
    _bad("nonzero", good[:28] + struct.pack("<4H", 3, 7, 1, 808), n, "index 808 of chunk 2 out of range 0..807")
    _bad("nonzero", good[:28] + struct.pack("<4H", 7, 3, 1, 807), n, "indices of chunk 0 are not strictly increasing")
    _bad("nonzero", good[:28] + struct.pack("<4H", 3, 3, 1, 807), n, "not strictly increasing")


@pytest.mark.parametrize("spec", ["sparseloco:0", "sparseloco:0.3", "sparseloco:nan", "nonzero:0.1", "sparseloco:x"])
def test_bad_specs_are_refused_by_name(spec):
    with pytest.raises(ValueError, match=f"codec {spec!r}"):
        Codec.parse(spec)


def test_sizes_and_joins():
    assert Codec.parse("sparseloco").density == 0.02
    # 2 levels per chunk, then per kept value a 16-bit index and 2 bits
    assert Codec.parse("sparseloco:0.02").payload_bytes(3 * CHUNK) == 3 * 8 + 3 * 82 * 2 + math.ceil(3 * 82 / 4)
    with pytest.raises(ValueError, match="nonzeros"):
        Codec.parse("nonzero").payload_bytes(10)
    # a nonzero view starts from the BF16 values themselves, so unchanged entries stay exactly 0
    assert Codec.parse("nonzero").whole == Codec("bf16") and Codec.parse("sparse").whole == Codec("int8")
