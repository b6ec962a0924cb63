"""The bounded sparse pull (``sparsebf16:D``: per chunk of 4096 values its top-k, 16-bit indices and
BF16 values), against a reference written here from its definition (NumPy, BF16 rounded to nearest
even on the FP32 bits, bytes packed with ``struct``), over lengths around every chunk boundary and
broad value generators, and every way a payload can fail to fit its unit."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from dips.codec import CHUNK, Codec

from test_codec import generators
from test_codec_sparse_sign import SPARSE_LENGTHS


def bf16_bits(v: float) -> int:
    """The BF16 nearest FP32 ``v`` (ties to even), as its 16 bits: the FP32 bits plus 0x7FFF plus
    the lowest kept bit, cut to the upper half."""
    u = struct.unpack("<I", struct.pack("<f", v))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def ref_sparsebf16(x: np.ndarray, density: float) -> tuple[bytes, np.ndarray]:
    """Per chunk: its k = ceil(density * size) largest magnitudes (at least 1), indices
    increasing; then every kept value as BF16. Layout: all the chunks' 16-bit indices, then all
    the values."""
    idx_all, bits = [], []
    dec = np.zeros(len(x), dtype=np.float32)
    for start in range(0, len(x), CHUNK):
        chunk = x[start: start + CHUNK]
        k = min(len(chunk), max(1, math.ceil(density * len(chunk))))
        idx = sorted(sorted(range(len(chunk)), key=lambda i: -abs(float(chunk[i])))[:k])
        for i in idx:
            bits.append(bf16_bits(float(chunk[i])))
            dec[start + i] = bf16_value(bits[-1])
        idx_all += idx
    return struct.pack(f"<{len(idx_all)}H{len(bits)}H", *idx_all, *bits), dec


@pytest.mark.parametrize("spec", ["sparsebf16:0.01", "sparsebf16:0.04", "sparsebf16:0.25"])
def test_sparsebf16_round_trip_matches_the_reference(spec):
    codec = Codec.parse(spec)
    rng = np.random.default_rng(23)
    for n in SPARSE_LENGTHS:
        for name, x in generators(n, rng).items():
            if name in ("ties", "zero block", "tiny"):
                continue  # which equal magnitudes top-k keeps is not defined (denormals tie often)
            payload, dec = codec.round_trip(torch.from_numpy(x))
            want_payload, want_dec = ref_sparsebf16(x, codec.density)
            assert len(payload) == codec.payload_bytes(n) == len(want_payload), (spec, n, name)
            assert payload == want_payload, (spec, n, name)
            np.testing.assert_array_equal(dec.numpy(), want_dec, err_msg=f"{spec} n={n} {name}")
            assert torch.equal(codec.decode(payload, n), dec)


def test_sparsebf16_by_hand():
    """One chunk of 8 at density 0.25 keeps the 2 largest magnitudes, 1 + 3 * 2^-8 and
    -(1 + 2^-8), in index order. BF16 keeps 7 fraction bits: both lie halfway between two BF16
    values and round to the even one, 1 + 2^-6 and -1."""
    x = torch.tensor([0.5, 1 + 3 * 2 ** -8, 0.0, -0.25, -(1 + 2 ** -8), 0.125, 0.75, -0.5])
    payload, dec = Codec.parse("sparsebf16:0.25").round_trip(x)
    assert dec.tolist() == [0.0, 1 + 2 ** -6, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    assert struct.unpack("<2H", payload[:4]) == (1, 4)
    assert payload[4:] == struct.pack("<2H", 0x3F82, 0xBF80)


def _bad(payload: bytes, n: int, match: str, spec: str = "sparsebf16:0.03") -> None:
    with pytest.raises(ValueError, match=match):
        Codec.parse(spec).decode(payload, n, what="unit layers.0")


def test_a_sparsebf16_payload_that_does_not_fit_is_refused():
    n = 2 * CHUNK + 808
    codec = Codec.parse("sparsebf16:0.03")
    good = codec.encode(torch.randn(n))
    k = codec.kept(n)
    per = math.ceil(0.03 * CHUNK)
    _bad(good[:-1], n, f"bytes of sparsebf16:0.03 for {n} values; expected {4 * k}")
    _bad(good + b"\0\0", n, "expected")
    _bad(good, n + CHUNK, "expected")
    idx = list(struct.unpack(f"<{k}H", good[:2 * k]))

    def with_idx(new: list[int]) -> bytes:
        return struct.pack(f"<{k}H", *new) + good[2 * k:]

    _bad(with_idx(idx[:per - 1] + [CHUNK] + idx[per:]), n, "index 4096 of chunk 0 out of range 0..4095")
    _bad(with_idx(idx[:-1] + [808]), n, "index 808 of chunk 2 out of range 0..807")
    _bad(with_idx([idx[0]] + idx[:per - 1] + idx[per:]), n, "indices of chunk 0 are not strictly increasing")
    swapped = idx[:]
    swapped[per], swapped[per + 1] = swapped[per + 1], swapped[per]
    _bad(with_idx(swapped), n, "indices of chunk 1 are not strictly increasing")
    for bits, words in [(0x7FC0, "value nan at 5"), (0x7F80, "value inf at 5"), (0xFF80, "value -inf at 5")]:
        at = 2 * k + 2 * 5
        _bad(good[:at] + struct.pack("<H", bits) + good[at + 2:], n, words)
    assert torch.equal(codec.decode(good, n), codec.round_trip(codec.decode(good, n))[1])  # the good one reads


@pytest.mark.parametrize("spec", ["sparsebf16:0", "sparsebf16:0.3", "sparsebf16:nan", "sparsebf16:x", "sparsebf16:-1"])
def test_bad_specs_are_refused_by_name(spec):
    with pytest.raises(ValueError, match=f"codec {spec!r}"):
        Codec.parse(spec)


def test_sizes_and_joins():
    codec = Codec.parse("sparsebf16")
    assert codec.density == 0.02 and codec.fixed_size and codec.lossy
    # per kept value a 16-bit index and a BF16 value, nothing per chunk: 82 of each full chunk, 1 of 7
    assert codec.payload_bytes(3 * CHUNK + 7) == 4 * (3 * 82 + 1)
    # a view starts from the BF16 values themselves, so entries no round changed stay exactly 0
    assert codec.whole == Codec("bf16")
    with pytest.raises(ValueError, match="beyond BF16's range"):
        codec.encode(torch.tensor([3.4e38, 1.0]))  # rounds to BF16 infinity
