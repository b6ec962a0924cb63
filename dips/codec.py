"""How a unit's values are compressed on the wire: BF16, int8 or 4-bit codes with a scale per
block of 64 values, the top-k values by magnitude (their indices and int8 codes), or the top-k
of each chunk of 4096 values (16-bit indices within the chunk, int8 codes, a scale per chunk), or
every value's sign with a scale per block of 256 (1 bit a value; ``sign:F`` sends only the
fraction F of the blocks whose signs remove the most error, with their indices), SparseLoCo's
push (``sparseloco:D``: each chunk's top-k with 2-bit codes; the cluster's error feedback decays
by ``DECAY``), the nonzero entries of a difference exactly (``nonzero``: 16-bit indices within
chunks and FP32 values, a pull whose size follows from how many entries changed), or each chunk's
top-k with BF16 values (``sparsebf16:D``: a pull of bounded size, 4 bytes a kept value).

A payload's size follows from the codec and the unit's element count alone (for ``nonzero``,
from the per-chunk counts at its start, each bounded by its chunk), so a receiver checks the
length before it reads anything; every index, scale and code is then checked (range,
order, finite) and a payload that does not fit is refused whole with a ``ValueError`` naming
what is wrong. The sender learns what the receiver will decode by decoding its own payload
(:meth:`Codec.round_trip`), so error feedback keeps exactly what the wire dropped.

PyTorch has per-channel and per-tensor quantization but no block-scaled 4-bit or sparse
top-k format with a fixed byte layout, so the codes are packed here by hand.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

BLOCK = 64                       # values sharing one FP32 scale
KINDS = ("bf16", "int8", "int4", "sign", "topk", "sparse", "sparseloco", "sparsebf16", "nonzero")
SPARSE = ("topk", "sparse", "sparseloco", "sparsebf16")  # the kinds that send a fraction of the values
CHUNKED = ("sparse", "sparseloco", "sparsebf16")  # top-k per chunk, 16-bit indices within it
DECAY = 0.95                     # sparseloco: the cluster's error feedback e <- DECAY e + pseudo-gradient
CHUNK = 4096                     # sparse: values sharing one top-k choice, one scale and 16-bit indices
SIGN_BLOCK = 256                 # sign: values sharing one FP32 scale (their mean magnitude)
EXACT_JOIN = ("nonzero", "sparsebf16")  # pulls whose join is the BF16 values themselves
DEFAULT_DENSITY = 0.02           # top-k without a density keeps this fraction of the values
MAX_DENSITY = 0.25               # beyond ~0.21 top-k's (0.35 sparse's) indices make it larger than int8
MAX_SPEC_CHARS = 32
_QMAX = {"int8": 127, "int4": 7}  # symmetric codes: -128 (int8) and -8 (int4) are never sent
MAX_ELEMENTS = 2 ** 31 - 1       # top-k indices are int32


@dataclasses.dataclass(frozen=True)
class Codec:
    """One wire format; ``density`` is the fraction top-k and sparse keep of the values, or sign:F
    of the sign blocks (0 for the others and plain sign)."""

    kind: str
    density: float = 0.0

    @classmethod
    def parse(cls, spec: object) -> "Codec":
        """``bf16``, ``int8``, ``int4``, ``nonzero``, ``sign[:F]`` (0 < F < 1), ``topk[:D]``,
        ``sparse[:D]``, ``sparseloco[:D]`` or ``sparsebf16[:D]`` (0 < D <= 0.25), as a peer or a
        flag gives it;
        ``ValueError`` naming the spec otherwise."""
        expected = ("expected one of bf16, int8, int4, sign[:FRACTION], topk[:DENSITY], sparse[:DENSITY], "
                    "sparseloco[:DENSITY], sparsebf16[:DENSITY], nonzero")
        if not isinstance(spec, str) or not 0 < len(spec) <= MAX_SPEC_CHARS:
            raise ValueError(f"codec {str(spec)[:40]!r}: {expected}")
        kind, _, arg = spec.partition(":")
        if kind not in KINDS or (arg and kind not in SPARSE + ("sign",)):
            raise ValueError(f"codec {spec!r}: {expected}")
        if kind == "sign" and arg:
            try:
                fraction = float(arg)
            except ValueError:
                fraction = math.nan
            if not 0.0 < fraction < 1.0:  # NaN fails too
                raise ValueError(f"codec {spec!r}: fraction of sign blocks {arg!r}; expected a number in (0, 1)")
            return cls(kind, fraction)
        if kind not in SPARSE:
            return cls(kind)
        try:
            density = float(arg) if arg else DEFAULT_DENSITY
        except ValueError:
            density = math.nan
        if not 0.0 < density <= MAX_DENSITY:  # NaN fails too
            raise ValueError(f"codec {spec!r}: top-k density {arg!r}; expected a number in (0, {MAX_DENSITY}]")
        return cls(kind, density)

    @classmethod
    def parse_push(cls, spec: "str | Codec") -> "Codec":
        """``parse`` for a push's codec (or a codec already parsed): ``ValueError`` for a pull-only
        one, whose payload's size does not follow from the unit's."""
        codec = spec if isinstance(spec, Codec) else cls.parse(spec)
        if not codec.fixed_size:
            raise ValueError(f"codec {str(codec)!r} carries pulls, not pushes (a pull codec: a push's size must "
                             f"follow from its unit)")
        return codec

    def __str__(self) -> str:
        return f"{self.kind}:{self.density:g}" if self.kind in SPARSE or self.density else self.kind

    @property
    def lossy(self) -> bool:
        """Whether values cross as a compressed difference (every codec but BF16 parameters)."""
        return self.kind != "bf16"

    @property
    def decay(self) -> float:
        """What the cluster's error feedback keeps of the last residual at each push: ``DECAY`` for
        SparseLoCo's push (the accumulator plays outer momentum's role), all of it otherwise."""
        return DECAY if self.kind == "sparseloco" else 1.0

    @property
    def fixed_size(self) -> bool:
        """Whether a payload's size follows from the unit's size alone (all but ``nonzero``)."""
        return self.kind != "nonzero"

    @property
    def whole(self) -> "Codec":
        """How whole values travel when a pull in this codec has nothing to be a difference from
        (a join): int8 for every compressed pull (a sparse payload could not carry a model, and
        4-bit codes would leave an error larger than many rounds' updates), BF16 otherwise and
        for ``nonzero`` and ``sparsebf16``, whose later pulls carry what changed: a view equal
        to the BF16 parameters keeps every unchanged entry's difference exactly 0, so top-k
        picks changes, not the codes' error."""
        return Codec("int8") if self.lossy and self.kind not in EXACT_JOIN else Codec("bf16")

    def kept(self, n: int) -> int:
        """How many of ``n`` values top-k sends (``n`` for the dense codecs; for sparse, the sum
        over its chunks)."""
        if self.kind in CHUNKED:
            return sum(self._chunk_kept(n))
        return min(n, max(1, math.ceil(self.density * n))) if self.kind == "topk" else n

    def _chunk_kept(self, n: int) -> list[int]:
        """Sparse: how many values each chunk of ``n`` values keeps (all full chunks the same)."""
        full, rest = divmod(n, CHUNK)
        keep = Codec("topk", self.density).kept
        return [keep(CHUNK)] * full + ([keep(rest)] if rest else [])

    def payload_bytes(self, n: int, nonzeros: int | None = None) -> int:
        """The exact payload size of ``n`` values (for ``nonzero``, of which ``nonzeros`` are sent)."""
        if self.kind == "nonzero":
            if nonzeros is None:
                raise ValueError("nonzero: a payload's size depends on how many values it sends; give nonzeros")
            return 4 * _chunks(n) + 6 * nonzeros
        if self.kind == "bf16":
            return 2 * n
        if self.kind == "int8":
            return 4 * _blocks(n) + n
        if self.kind == "int4":
            return 4 * _blocks(n) + (n + 1) // 2
        if self.kind == "sign":
            if self.density:
                return self._sign_kept(n) * (8 + SIGN_BLOCK // 8)
            return 4 * _sign_blocks(n) + (n + 7) // 8
        if self.kind == "sparse":
            return 4 * _chunks(n) + 3 * self.kept(n)
        if self.kind == "sparseloco":
            k = self.kept(n)
            return 8 * _chunks(n) + 2 * k + (k + 3) // 4
        if self.kind == "sparsebf16":
            return 4 * self.kept(n)
        k = self.kept(n)
        return 4 * k + 4 * _blocks(k) + k

    def encode(self, x: torch.Tensor) -> bytes:
        """The payload of the flat values ``x`` (FP32, finite)."""
        return self.round_trip(x)[0]

    def round_trip(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The payload of the flat values ``x`` and what a receiver decodes from it (FP32)."""
        x = x.detach().reshape(-1).to(torch.float32)
        if not torch.isfinite(x).all():
            raise ValueError(f"{self}: cannot encode non-finite values")
        if not 0 < x.numel() <= MAX_ELEMENTS:
            raise ValueError(f"{self}: {x.numel()} values; expected 1..{MAX_ELEMENTS} per unit")
        if self.kind == "bf16":
            payload = x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        elif self.kind in _QMAX:
            scales, codes = _quantize(x, _QMAX[self.kind])
            payload = _bytes(scales) + (_bytes(codes) if self.kind == "int8" else _pack4(codes))
        elif self.kind in CHUNKED:
            payload = self._encode_sparse(x)
        elif self.kind == "nonzero":
            payload = _encode_nonzero(x)
        elif self.kind == "sign":
            payload = self._encode_sign(x)
        else:
            k = self.kept(x.numel())
            idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values.to(torch.int32)
            scales, codes = _quantize(x[idx.long()], _QMAX["int8"])
            payload = _bytes(idx) + _bytes(scales) + _bytes(codes)
        return payload, self.decode(payload, x.numel())

    def decode(self, payload: bytes | memoryview, n: int, what: str = "payload") -> torch.Tensor:
        """The ``n`` flat FP32 values of ``payload``; ``ValueError`` naming ``what`` and the part
        that does not fit (size, index, scale, code, value), with nothing decoded."""
        if not 0 < n <= MAX_ELEMENTS:
            raise ValueError(f"{what}: {n} values; expected 1..{MAX_ELEMENTS}")
        if self.kind == "nonzero":
            return _decode_nonzero(bytearray(payload), n, what)
        want = self.payload_bytes(n)
        if len(payload) != want:
            raise ValueError(f"{what}: {len(payload)} bytes of {self} for {n} values; expected {want}")
        buf = bytearray(payload)
        if self.kind == "bf16":
            out = torch.frombuffer(buf, dtype=torch.bfloat16).float()
        elif self.kind in _QMAX:
            nb = _blocks(n)
            scales = _scales(buf, 0, nb, what)
            codes = (torch.frombuffer(buf, dtype=torch.int8, offset=4 * nb, count=n) if self.kind == "int8"
                     else _unpack4(buf, 4 * nb, n, what))
            out = _dequantize(scales, _checked_codes(codes, _QMAX[self.kind], what), n)
        elif self.kind in CHUNKED:
            out = self._decode_sparse(buf, n, what)
        elif self.kind == "sign":
            out = self._decode_sign(buf, n, what)
        else:
            k = self.kept(n)
            idx = _checked_indices(buf, k, n, f"{what}: top-k index", f"{what}: top-k indices")
            nb = _blocks(k)
            scales = _scales(buf, 4 * k, nb, what)
            codes = torch.frombuffer(buf, dtype=torch.int8, offset=4 * k + 4 * nb, count=k)
            out = torch.zeros(n)
            out[idx] = _dequantize(scales, _checked_codes(codes, _QMAX["int8"], what), k)
        if not torch.isfinite(out).all():
            raise ValueError(f"{what}: decodes to non-finite values")
        return out

    def _encode_sparse(self, x: torch.Tensor) -> bytes:
        """Each chunk's k largest magnitudes: the chunks' FP32 scales, then every chunk's 16-bit
        indices within it (increasing), then every chunk's codes: ``sparse`` int8 codes in
        -127..127 (scale: kept absmax / 127); ``sparseloco`` see ``_encode_two_levels``;
        ``sparsebf16`` has no scales, its values are BF16 (rounded to nearest even)."""
        n = x.numel()
        kept = self._chunk_kept(n)
        full = n // CHUNK
        parts = []
        if full:
            parts.append(_chunk_topk(x[:full * CHUNK].view(full, CHUNK), kept[0]))
        if len(kept) > full:
            parts.append(_chunk_topk(x[full * CHUNK:].view(1, -1), kept[-1]))
        idx = torch.cat([p[0].reshape(-1) for p in parts])
        vals = [p[1] for p in parts]
        if self.kind == "sparseloco":
            return _encode_two_levels(idx, torch.cat([v.reshape(-1) for v in vals]), kept)
        if self.kind == "sparsebf16":
            values = torch.cat([v.reshape(-1) for v in vals]).to(torch.bfloat16)
            if not torch.isfinite(values).all():
                raise ValueError(f"{self}: values beyond BF16's range")
            return _bytes(idx.to(torch.int16)) + _bytes(values.view(torch.int16))
        scales = torch.cat([v.abs().amax(dim=1) / _QMAX["int8"] for v in vals])
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes, at = [], 0
        for v in vals:
            codes.append(torch.round(v / safe[at:at + len(v), None]).clamp_(-127, 127).to(torch.int8).reshape(-1))
            at += len(v)
        return _bytes(scales) + _bytes(idx.to(torch.int16)) + _bytes(torch.cat(codes))

    def _decode_sparse(self, buf: bytearray, n: int, what: str) -> torch.Tensor:
        kept = self._chunk_kept(n)
        m, k = len(kept), sum(kept)
        # sparseloco: each chunk's low and high magnitude; sparsebf16: none
        nscales = {"sparse": m, "sparseloco": 2 * m, "sparsebf16": 0}[self.kind]
        scales = _scales(buf, 0, nscales, what) if nscales else None
        idx = torch.frombuffer(buf, dtype=torch.int16, offset=4 * nscales, count=k).to(torch.int64) & 0xFFFF
        if self.kind == "sparsebf16":
            values = torch.frombuffer(buf, dtype=torch.bfloat16, offset=2 * k, count=k).float()
            bad = ~torch.isfinite(values)
            if bad.any():
                i = int(bad.nonzero()[0])
                raise ValueError(f"{what}: sparsebf16 value {float(values[i])} at {i}; expected a finite number")
        elif self.kind == "sparse":
            codes = _checked_codes(torch.frombuffer(buf, dtype=torch.int8, offset=4 * m + 2 * k, count=k),
                                   _QMAX["int8"], what)
        else:
            codes = _unpack2(buf, 8 * m + 2 * k, k, what)
        chunk = torch.repeat_interleave(torch.arange(m), torch.tensor(kept))
        _check_chunk_indices(idx, chunk, _chunk_sizes(n), "sparse", what)
        out = torch.zeros(n)
        if self.kind == "sparsebf16":
            out[chunk * CHUNK + idx] = values
        elif self.kind == "sparse":
            out[chunk * CHUNK + idx] = codes.float() * scales[chunk]
        else:
            levels = scales.view(m, 2)[chunk, codes >> 1]
            out[chunk * CHUNK + idx] = torch.where(codes & 1 == 1, levels, -levels)
        return out

    def _sign_kept(self, n: int) -> int:
        """sign:F: how many of the blocks of ``n`` values it sends."""
        nb = _sign_blocks(n)
        return min(nb, max(1, math.ceil(self.density * nb)))

    def _encode_sign(self, x: torch.Tensor) -> bytes:
        """Each block's mean magnitude (FP32; the scale that makes sign x scale closest to the
        block in L2), then one bit a value, 1 for >= 0, eight a byte, the first in the lowest bit,
        unused bits 0. sign:F: first the sent blocks' int32 indices (increasing), each sent
        block's bits padded to 256; the blocks sent are those whose signs remove the most squared
        error, (sum |x|)^2 / size."""
        n = x.numel()
        nb = _sign_blocks(n)
        padded = torch.zeros(nb * SIGN_BLOCK, dtype=torch.float64)
        padded[:n] = x.abs()
        counts = torch.full((nb,), float(SIGN_BLOCK), dtype=torch.float64)
        counts[-1] = n - (nb - 1) * SIGN_BLOCK
        sums = padded.view(nb, SIGN_BLOCK).sum(dim=1)
        scales = (sums / counts).to(torch.float32)
        if not self.density:
            return _bytes(scales) + np.packbits((x >= 0).numpy(), bitorder="little").tobytes()
        idx = torch.topk(sums * sums / counts, self._sign_kept(n), sorted=False).indices.sort().values
        signs = torch.zeros(nb * SIGN_BLOCK, dtype=torch.bool)
        signs[:n] = x >= 0
        bits = np.packbits(signs.view(nb, SIGN_BLOCK)[idx].numpy(), axis=1, bitorder="little")
        return _bytes(idx.to(torch.int32)) + _bytes(scales[idx]) + bits.tobytes()

    def _decode_sign(self, buf: bytearray, n: int, what: str) -> torch.Tensor:
        nb = _sign_blocks(n)
        if not self.density:
            scales = _scales(buf, 0, nb, what)
            bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8, offset=4 * nb, count=(n + 7) // 8),
                                 bitorder="little")
            if bits[n:].any():
                raise ValueError(f"{what}: the padding bits after {n} signs are {bits[n:].tolist()}; expected 0")
            return (torch.from_numpy(bits[:n].astype(np.float32)) * 2 - 1) * scales.repeat_interleave(SIGN_BLOCK)[:n]
        kb = self._sign_kept(n)
        idx = _checked_indices(buf, kb, nb, f"{what}: sign block", f"{what}: sign block indices")
        scales = _scales(buf, 4 * kb, kb, what)
        bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8, offset=8 * kb, count=kb * SIGN_BLOCK // 8),
                             bitorder="little").reshape(kb, SIGN_BLOCK)
        tail = n - (nb - 1) * SIGN_BLOCK
        if int(idx[-1]) == nb - 1 and bits[-1, tail:].any():
            raise ValueError(f"{what}: the padding bits after {n} signs are not 0")
        rows = (torch.from_numpy(bits.astype(np.float32)) * 2 - 1) * scales[:, None]
        out = torch.zeros(nb, SIGN_BLOCK)
        out[idx] = rows
        return out.reshape(-1)[:n].contiguous()


def _checked_indices(buf: bytearray, k: int, limit: int, one: str, all_: str) -> torch.Tensor:
    """The ``k`` int32 indices at the payload's start, each in 0..limit-1 and strictly increasing,
    else ``ValueError`` naming the first bad one (``one``: how an index is named, ``all_``: the
    indices)."""
    idx = torch.frombuffer(buf, dtype=torch.int32, count=k).long()
    if int(idx.min()) < 0 or int(idx.max()) >= limit:
        bad = idx[(idx < 0) | (idx >= limit)][0]
        raise ValueError(f"{one} {int(bad)} out of range 0..{limit - 1}")
    if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise ValueError(f"{all_} are not strictly increasing")
    return idx


def _sign_blocks(n: int) -> int:
    return (n + SIGN_BLOCK - 1) // SIGN_BLOCK


def _chunk_topk(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest magnitudes: their indices in the row (increasing) and values."""
    idx = torch.topk(rows.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx, torch.gather(rows, 1, idx)


def _chunks(n: int) -> int:
    return (n + CHUNK - 1) // CHUNK


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _quantize(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 scales (block absmax / qmax) and int8 codes in -qmax..qmax, rounded to nearest."""
    n = x.numel()
    padded = torch.zeros(_blocks(n) * BLOCK)
    padded[:n] = x
    blocks = padded.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return scales, codes.reshape(-1)[:n]


def _dequantize(scales: torch.Tensor, codes: torch.Tensor, n: int) -> torch.Tensor:
    return codes.float() * scales.repeat_interleave(BLOCK)[:n]


def _scales(buf: bytearray, offset: int, count: int, what: str) -> torch.Tensor:
    scales = torch.frombuffer(buf, dtype=torch.float32, offset=offset, count=count)
    bad = ~torch.isfinite(scales) | (scales < 0)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"{what}: scale {float(scales[i])} of block {i}; expected a finite number >= 0")
    return scales


def _checked_codes(codes: torch.Tensor, qmax: int, what: str) -> torch.Tensor:
    if int(codes.min()) < -qmax:
        raise ValueError(f"{what}: code {int(codes.min())}; expected codes in -{qmax}..{qmax}")
    return codes


def _encode_two_levels(idx: torch.Tensor, vals: torch.Tensor, kept: list[int]) -> bytes:
    """sparseloco: each chunk's kept values as a sign and one of two magnitudes. A chunk's kept
    magnitudes split at the middle of their range, t = (min + max) / 2; its low level is the mean
    of those below t (the high level when none is), its high level the mean of those at or above
    it (each FP32, from FP64 sums); a value's 2-bit code is 1 for >= 0 plus 2 for the high
    level. Layout: every chunk's (low, high), then the 16-bit indices, then the codes, four a
    byte, the first in the lowest bits, unused bits 0."""
    chunk = torch.repeat_interleave(torch.arange(len(kept)), torch.tensor(kept))
    mags = vals.abs().double()
    lo_t = torch.segment_reduce(mags, "min", lengths=torch.tensor(kept))
    hi_t = torch.segment_reduce(mags, "max", lengths=torch.tensor(kept))
    high = mags >= ((lo_t + hi_t) / 2)[chunk]
    n_hi = torch.zeros(len(kept), dtype=torch.float64).index_add_(0, chunk, high.double())
    s_hi = torch.zeros(len(kept), dtype=torch.float64).index_add_(0, chunk, torch.where(high, mags, 0.0))
    s_lo = torch.zeros(len(kept), dtype=torch.float64).index_add_(0, chunk, torch.where(high, 0.0, mags))
    n_lo = torch.tensor(kept, dtype=torch.float64) - n_hi
    hi = s_hi / n_hi  # the largest magnitude is always at or above t
    lo = torch.where(n_lo > 0, s_lo / n_lo.clamp(min=1), hi)
    scales = torch.stack([lo, hi], dim=1).to(torch.float32).reshape(-1)
    codes = (vals >= 0).to(torch.uint8) + 2 * high.to(torch.uint8)
    return _bytes(scales) + _bytes(idx.to(torch.int16)) + _pack2(codes)


def _pack2(codes: torch.Tensor) -> bytes:
    """Four 2-bit codes (0..3) a byte, the first in the lowest bits; unused bits 0."""
    u = torch.zeros((codes.numel() + 3) // 4 * 4, dtype=torch.uint8)
    u[:codes.numel()] = codes
    u = u.view(-1, 4)
    return _bytes(u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6))


def _unpack2(buf: bytearray, offset: int, k: int, what: str) -> torch.Tensor:
    packed = torch.frombuffer(buf, dtype=torch.uint8, offset=offset, count=(k + 3) // 4)
    u = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1)
    if u[k:].any():
        raise ValueError(f"{what}: the padding bits after {k} 2-bit codes are {u[k:].tolist()}; expected 0")
    return u[:k].long()


def _encode_nonzero(x: torch.Tensor) -> bytes:
    """The nonzero values of ``x``, exactly: each chunk of 4096's count (uint32), then every
    value (FP32), then every value's 16-bit index within its chunk (increasing)."""
    n = x.numel()
    at = x.nonzero().reshape(-1)
    counts = torch.bincount(at // CHUNK, minlength=_chunks(n)).to(torch.int32)
    return _bytes(counts) + _bytes(x[at]) + _bytes((at % CHUNK).to(torch.int16))


def _decode_nonzero(buf: bytearray, n: int, what: str) -> torch.Tensor:
    """``nonzero``'s ``n`` values: every count within its chunk's size, the length the counts
    give, indices in range and strictly increasing within a chunk, values finite and nonzero."""
    m = _chunks(n)
    if len(buf) < 4 * m:
        raise ValueError(f"{what}: {len(buf)} bytes of nonzero for {n} values; expected at least {4 * m} "
                         f"(the counts of its {m} chunks)")
    counts = torch.frombuffer(buf, dtype=torch.int32, count=m).long()  # beyond 2^31: negative, refused
    size = _chunk_sizes(n)
    bad = (counts < 0) | (counts > size)
    if bad.any():
        c = int(bad.nonzero()[0])
        raise ValueError(f"{what}: nonzero count {int(counts[c])} of chunk {c}; expected 0..{int(size[c])}")
    k = int(counts.sum())
    if len(buf) != 4 * m + 6 * k:
        raise ValueError(f"{what}: {len(buf)} bytes of nonzero for {n} values with {k} sent; "
                         f"expected {4 * m + 6 * k}")
    out = torch.zeros(n)
    if not k:
        return out
    values = torch.frombuffer(buf, dtype=torch.float32, offset=4 * m, count=k)
    idx = torch.frombuffer(buf, dtype=torch.int16, offset=4 * m + 4 * k, count=k).to(torch.int64) & 0xFFFF
    chunk = torch.repeat_interleave(torch.arange(m), counts)
    _check_chunk_indices(idx, chunk, size, "nonzero", what)
    bad = ~torch.isfinite(values) | (values == 0)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"{what}: nonzero value {float(values[i])} at {i}; expected a finite number other than 0")
    out[chunk * CHUNK + idx] = values
    return out


def _chunk_sizes(n: int) -> torch.Tensor:
    """How many of ``n`` values each chunk holds (CHUNK, the last one fewer)."""
    return torch.tensor([min(CHUNK, n - c * CHUNK) for c in range(_chunks(n))])


def _check_chunk_indices(idx: torch.Tensor, chunk: torch.Tensor, sizes: torch.Tensor, form: str, what: str) -> None:
    """``ValueError`` naming the first index (within its chunk, ``chunk`` giving each one's) out of
    its chunk's range, or the first chunk whose indices are not strictly increasing."""
    bad = idx >= sizes[chunk]
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"{what}: {form} index {int(idx[i])} of chunk {int(chunk[i])} out of range "
                         f"0..{int(sizes[chunk[i]]) - 1}")
    same = chunk[1:] == chunk[:-1]
    if bool((same & (idx[1:] <= idx[:-1])).any()):
        c = int(chunk[1:][same & (idx[1:] <= idx[:-1])][0])
        raise ValueError(f"{what}: {form} indices of chunk {c} are not strictly increasing")


def _pack4(codes: torch.Tensor) -> bytes:
    """Two 4-bit codes a byte, stored as code + 8 (1..15), the first in the low nibble; an odd
    count's last high nibble is 0."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.zeros(1, dtype=torch.uint8)])
    return _bytes(u[0::2] | (u[1::2] << 4))


def _unpack4(buf: bytearray, offset: int, n: int, what: str) -> torch.Tensor:
    packed = torch.frombuffer(buf, dtype=torch.uint8, offset=offset, count=(n + 1) // 2)
    u = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)
    if n % 2 and int(u[-1]) != 0:
        raise ValueError(f"{what}: the padding nibble after {n} 4-bit codes is {int(u[-1])}; expected 0")
    return (u[:n].to(torch.int16) - 8).to(torch.int8)
