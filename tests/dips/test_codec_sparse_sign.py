"""The sub-byte codecs, ``sparse:D`` (top-k per chunk of 4096 values), ``sign`` (1 bit a value)
and ``sign:F`` (the fraction F of the sign blocks), against references written here from their
definitions (NumPy FP32 and exact float sums, bytes packed with ``struct``), over lengths around
every chunk and block boundary and broad value generators, and every way a payload can fail to
fit its unit."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from dips.codec import CHUNK, SIGN_BLOCK, Codec

from test_codec import generators, ref_quantize

SPARSE_LENGTHS = [1, 2, 3, 63, 64, 65, 127, 4095, 4096, 4097, 4159, 8191, 8192, 8193, 3 * 4096 + 1000]


def ref_sparse(x: np.ndarray, density: float) -> tuple[bytes, np.ndarray]:
    """Per chunk of 4096: its k = ceil(density * size) largest magnitudes (at least 1), indices
    increasing, int8 codes with one scale (kept absmax / 127); scales, indices, codes in order."""
    scales, idx_all, codes_all = [], [], []
    dec = np.zeros(len(x), dtype=np.float32)
    for start in range(0, len(x), CHUNK):
        chunk = x[start: start + CHUNK]
        k = min(len(chunk), max(1, math.ceil(density * len(chunk))))
        idx = sorted(sorted(range(len(chunk)), key=lambda i: -abs(float(chunk[i])))[:k])
        s = np.float32(np.abs(chunk[idx]).max()) / np.float32(127)
        codes = [0 if s == 0 else int(np.clip(np.rint(chunk[i] / s), -127, 127)) for i in idx]
        scales.append(s)
        idx_all += idx
        codes_all += codes
        dec[[start + i for i in idx]] = np.array(codes, dtype=np.float32) * s
    k = len(idx_all)
    return struct.pack(f"<{len(scales)}f{k}H{k}b", *scales, *idx_all, *codes_all), dec


def ref_sign_bits(x: np.ndarray) -> bytes:
    """One bit a value (1 for >= 0), eight a byte, lowest bit first, unused bits 0."""
    bits = [1 if float(v) >= 0 else 0 for v in x] + [0] * (-len(x) % 8)
    return bytes(sum(bits[i + j] << j for j in range(8)) for i in range(0, len(bits), 8))


@pytest.mark.parametrize("spec", ["sparse:0.01", "sparse:0.03", "sparse:0.25"])
def test_sparse_round_trip_matches_the_reference(spec):
    codec = Codec.parse(spec)
    rng = np.random.default_rng(11)
    for n in SPARSE_LENGTHS:
        for name, x in generators(n, rng).items():
            if name in ("ties", "zero block"):
                continue  # which of equal magnitudes top-k keeps is not defined
            payload, dec = codec.round_trip(torch.from_numpy(x))
            want_payload, want_dec = ref_sparse(x, codec.density)
            assert len(payload) == codec.payload_bytes(n) == len(want_payload), (spec, n, name)
            assert payload == want_payload, (spec, n, name)
            np.testing.assert_array_equal(dec.numpy(), want_dec, err_msg=f"{spec} n={n} {name}")
            np.testing.assert_array_equal(codec.decode(payload, n).numpy(), want_dec)


def test_sparse_keeps_each_chunks_largest_magnitudes():
    g = torch.Generator().manual_seed(5)
    n = 2 * CHUNK + 500
    x = (torch.randperm(n, generator=g).float() + 1) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    dec = Codec.parse("sparse:0.02").round_trip(x)[1]
    for start in range(0, n, CHUNK):
        chunk = x[start: start + CHUNK]
        k = math.ceil(0.02 * len(chunk))
        want = {start + i for i in sorted(range(len(chunk)), key=lambda i: -abs(float(chunk[i])))[:k]}
        got = {i for i in dec.nonzero().flatten().tolist() if start <= i < start + CHUNK}
        assert got == want


def test_sign_round_trip_matches_the_reference_for_every_length():
    codec = Codec.parse("sign")
    rng = np.random.default_rng(13)
    for n in list(range(1, 3 * SIGN_BLOCK + 2)) + [4096 + 3]:
        for name, x in generators(n, rng).items():
            if name == "tiny":
                continue  # FP32 denormals: the mean magnitude underflows the same way, not bit for bit
            payload, dec = codec.round_trip(torch.from_numpy(x))
            assert len(payload) == codec.payload_bytes(n) == 4 * math.ceil(n / SIGN_BLOCK) + math.ceil(n / 8)
            nb = math.ceil(n / SIGN_BLOCK)
            scales = np.frombuffer(payload[: 4 * nb], dtype="<f4")
            # the scale is each block's mean magnitude (float64 sum, rounded once to FP32)
            want_scales = np.array([math.fsum(abs(float(v)) for v in x[b: b + SIGN_BLOCK]) / len(x[b: b + SIGN_BLOCK])
                                    for b in range(0, n, SIGN_BLOCK)], dtype=np.float32)
            np.testing.assert_allclose(scales, want_scales, rtol=1e-6, err_msg=f"n={n} {name}")
            assert payload[4 * nb:] == ref_sign_bits(x), (n, name)
            want_dec = np.where(x >= 0, 1.0, -1.0).astype(np.float32) * np.repeat(scales, SIGN_BLOCK)[:n]
            np.testing.assert_array_equal(dec.numpy(), want_dec, err_msg=f"n={n} {name}")
            np.testing.assert_array_equal(codec.decode(payload, n).numpy(), want_dec)


def test_sign_scale_is_the_best_one_for_the_signs():
    """For fixed signs, sign * s is nearest x in L2 at s = mean |x|: any other scale is farther."""
    x = torch.randn(SIGN_BLOCK) * 3
    dec = Codec.parse("sign").round_trip(x)[1]
    best = float((x - dec).norm())
    for f in (0.9, 0.99, 1.01, 1.1):
        assert float((x - dec * f).norm()) > best


def _bad(codec: str, payload: bytes, n: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Codec.parse(codec).decode(payload, n, what="unit layers.0")


@pytest.mark.parametrize("spec,n", [("sparse:0.03", 9000), ("sign", 700)])
def test_a_payload_of_the_wrong_length_is_refused(spec, n):
    good = Codec.parse(spec).encode(torch.randn(n))
    _bad(spec, good[:-1], n, "unit layers.0: .* bytes .* expected")
    _bad(spec, good + b"\0", n, "expected")
    _bad(spec, good, n + 4096, "expected")


@pytest.mark.parametrize("spec", ["sparse:0.03", "sign"])
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, -1.0])
def test_a_bad_scale_is_refused(spec, scale):
    n = 9000  # three chunks, 36 sign blocks
    good = bytearray(Codec.parse(spec).encode(torch.randn(n)))
    good[4:8] = struct.pack("<f", scale)  # the second chunk's (block's) scale
    _bad(spec, bytes(good), n, "scale .* of block 1")


def _sparse_indices(n: int, density: float = 0.03):
    codec = Codec(kind="sparse", density=density)
    payload = bytearray(codec.encode(torch.randn(n)))
    m, k = math.ceil(n / CHUNK), codec.kept(n)
    return payload, m, k, list(struct.unpack(f"<{k}H", payload[4 * m: 4 * m + 2 * k]))


@pytest.mark.parametrize("where,value,match", [
    ("first chunk", CHUNK, "index 4096 of chunk 0 out of range 0..4095"),
    ("first chunk", 65535, "index 65535 of chunk 0 out of range"),
    ("last chunk", 808, "index 808 of chunk 2 out of range 0..807"),
    ("dup", None, "indices of chunk 0 are not strictly increasing"),
    ("swap", None, "indices of chunk 1 are not strictly increasing")])
def test_a_bad_sparse_index_is_refused(where, value, match):
    n = 2 * CHUNK + 808
    payload, m, k, idx = _sparse_indices(n)
    per = math.ceil(0.03 * CHUNK)
    if where == "first chunk":
        idx[per - 1] = value
    elif where == "last chunk":
        idx[-1] = value
    elif where == "dup":
        idx[1] = idx[0]
    else:
        idx[per], idx[per + 1] = idx[per + 1], idx[per]
    payload[4 * m: 4 * m + 2 * k] = struct.pack(f"<{k}H", *idx)
    _bad("sparse:0.03", bytes(payload), n, match)


def test_sparse_indices_restart_at_each_chunk():
    """A chunk's indices may be smaller than the previous chunk's: each counts from its chunk."""
    n = 2 * CHUNK
    x = torch.zeros(n)
    x[CHUNK - 1] = 5.0  # the first chunk keeps its last value, the second its first
    x[CHUNK] = -3.0
    codec = Codec.parse("sparse:0.0001")
    payload, dec = codec.round_trip(x)
    assert struct.unpack("<2H", payload[8:12]) == (CHUNK - 1, 0)
    assert dec[CHUNK - 1] == 5.0 and dec[CHUNK] == -3.0 and int((dec != 0).sum()) == 2


def test_a_sparse_code_of_minus_128_is_refused():
    n = 5000
    payload, m, k, _ = _sparse_indices(n)
    payload[-1] = 0x80
    _bad("sparse:0.03", bytes(payload), n, "code -128")


def test_sign_padding_bits_must_be_zero():
    n = 10  # two bytes of signs, six padding bits
    payload = bytearray(Codec.parse("sign").encode(torch.randn(n)))
    payload[-1] |= 0x80
    _bad("sign", bytes(payload), n, "padding bits after 10 signs")


@pytest.mark.parametrize("spec", ["sparse:0", "sparse:0.3", "sparse:nan", "sparse:-1", "sign:1", "sign:0", "sign:1.5",
                                  "sign:nan", "sign:x"])
def test_bad_specs_are_refused_by_name(spec):
    with pytest.raises(ValueError, match="codec"):
        Codec.parse(spec)


def test_specs_and_sizes():
    assert [str(Codec.parse(s)) for s in ("sign", "sign:0.5", "sparse", "sparse:0.05")] == \
        ["sign", "sign:0.5", "sparse:0.02", "sparse:0.05"]
    n = 10 * CHUNK + 100
    k = 10 * math.ceil(0.05 * CHUNK) + math.ceil(0.05 * 100)
    assert Codec.parse("sparse:0.05").payload_bytes(n) == 11 * 4 + 3 * k
    assert Codec.parse("sign").payload_bytes(n) == 4 * math.ceil(n / SIGN_BLOCK) + math.ceil(n / 8)
    assert Codec.parse("sign:0.5").payload_bytes(n) == math.ceil(0.5 * math.ceil(n / SIGN_BLOCK)) * (4 + 4 + 32)


def ref_sign_blocks(x: np.ndarray, fraction: float) -> tuple[list[int], np.ndarray, bytes]:
    """sign:F by its definition: the ceil(F * blocks) blocks (at least 1) with the largest
    (sum |x|)^2 / size, increasing; their mean magnitudes; their signs, each block padded to 256 bits."""
    blocks = [x[b: b + SIGN_BLOCK] for b in range(0, len(x), SIGN_BLOCK)]
    sums = [math.fsum(abs(float(v)) for v in blk) for blk in blocks]
    kb = min(len(blocks), max(1, math.ceil(fraction * len(blocks))))
    idx = sorted(sorted(range(len(blocks)), key=lambda b: -sums[b] ** 2 / len(blocks[b]))[:kb])
    scales = np.array([sums[b] / len(blocks[b]) for b in idx], dtype=np.float32)
    bits = b"".join(ref_sign_bits(np.concatenate([blocks[b], np.zeros(SIGN_BLOCK - len(blocks[b]), np.float32) - 1]))
                    for b in idx)
    return idx, scales, bits


@pytest.mark.parametrize("spec", ["sign:0.1", "sign:0.5", "sign:0.9"])
def test_sign_blocks_round_trip_matches_the_reference(spec):
    codec = Codec.parse(spec)
    rng = np.random.default_rng(17)
    for n in [1, 2, 255, 256, 257, 511, 512, 513, 1000, 2 * 4096 + 7]:
        for name in ("normal", "cauchy", "magnitudes"):  # no equal block scores: which one wins a tie is not defined
            x = generators(n, rng)[name]
            payload, dec = codec.round_trip(torch.from_numpy(x))
            idx, scales, bits = ref_sign_blocks(x, codec.density)
            kb = len(idx)
            assert len(payload) == codec.payload_bytes(n) == kb * 40, (spec, n, name)
            assert list(struct.unpack(f"<{kb}i", payload[: 4 * kb])) == idx, (spec, n, name)
            got_scales = np.frombuffer(payload[4 * kb: 8 * kb], dtype="<f4")
            np.testing.assert_allclose(got_scales, scales, rtol=1e-6)
            assert payload[8 * kb:] == bits, (spec, n, name)
            want = np.zeros(n, dtype=np.float32)
            for b, s in zip(idx, got_scales):
                blk = x[b * SIGN_BLOCK: (b + 1) * SIGN_BLOCK]
                want[b * SIGN_BLOCK: b * SIGN_BLOCK + len(blk)] = np.where(blk >= 0, s, -s)
            np.testing.assert_array_equal(dec.numpy(), want, err_msg=f"{spec} n={n} {name}")
            np.testing.assert_array_equal(codec.decode(payload, n).numpy(), want)


def _sign_blocks_payload(n: int = 2000, spec: str = "sign:0.5"):
    codec = Codec.parse(spec)
    payload = bytearray(codec.encode(torch.from_numpy(generators(n, np.random.default_rng(3))["normal"])))
    kb = len(payload) // 40
    return payload, kb, list(struct.unpack(f"<{kb}i", payload[: 4 * kb]))


@pytest.mark.parametrize("value,match", [(8, "sign block 8 out of range 0..7"), (-1, "sign block -1 out of range"),
                                         ("dup", "not strictly increasing"), ("swap", "not strictly increasing")])
def test_a_bad_sign_block_index_is_refused(value, match):
    payload, kb, idx = _sign_blocks_payload()
    if value == "dup":
        idx[1] = idx[0]
    elif value == "swap":
        idx[0], idx[1] = idx[1], idx[0]
    else:
        idx[-1] = value
    payload[: 4 * kb] = struct.pack(f"<{kb}i", *idx)
    _bad("sign:0.5", bytes(payload), 2000, match)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0])
def test_a_bad_sign_block_scale_is_refused(scale):
    payload, kb, _ = _sign_blocks_payload()
    payload[4 * kb: 4 * kb + 4] = struct.pack("<f", scale)
    _bad("sign:0.5", bytes(payload), 2000, "scale .* of block 0")


def test_sign_block_padding_bits_must_be_zero():
    """The last block (2000 = 7 * 256 + 208) is sent with 48 padding bits, which must be 0."""
    x = torch.ones(2000) * 1e-3
    x[7 * 256:] = 5.0  # the last block has the largest score: it is sent
    payload = bytearray(Codec.parse("sign:0.1").encode(x))
    assert struct.unpack("<i", payload[:4]) == (7,)
    payload[-1] |= 0x01
    _bad("sign:0.1", bytes(payload), 2000, "padding bits")
