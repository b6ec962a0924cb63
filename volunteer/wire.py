"""Messages between stage servers and clients: a JSON header frame, then one frame per tensor.

No pickle: a header is plain JSON of bounded size, a tensor frame is raw bytes whose dtype and
shape the header declares and the receiver checks against what it expects before it builds the
tensor. ZeroMQ's ``MAXMSGSIZE`` (set per socket in ``security``) bounds each frame before it is
even read into memory; ``Message.decode`` bounds the rest.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable

import torch

from diutil import untrusted

MAX_HEADER_BYTES = 64 * 1024
MAX_TENSORS = 4
MAX_DIMS = 4
MAX_DEPTH = 16  # far deeper than any header (a JOB message carries the job as a nested object)
DTYPES = {"float32": torch.float32, "int64": torch.int64}
_NAMES = {v: k for k, v in DTYPES.items()}


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the receiver logs it and applies nothing."""


@dataclasses.dataclass
class Message:
    """``op`` names what the message asks or reports; ``fields`` are its JSON values."""

    op: str
    fields: dict[str, Any]
    tensors: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def encode(self) -> list[bytes | memoryview]:
        specs = []
        frames: list[bytes | memoryview] = []
        for t in self.tensors:
            t = t.detach().contiguous().cpu()
            specs.append({"dtype": _NAMES[t.dtype], "shape": list(t.shape)})
            frames.append(memoryview(t.numpy()).cast("B") if t.numel() else b"")
        header = json.dumps({"op": self.op, "fields": self.fields, "tensors": specs}).encode()
        return [header, *frames]

    @classmethod
    def decode(cls, frames: list[bytes]) -> "Message":
        """Parse ``frames``; every declared size is checked against the frames that came."""
        if not frames:
            raise ProtocolError("empty message")
        try:
            header = untrusted.json_object(frames[0], "header", MAX_HEADER_BYTES, max_depth=MAX_DEPTH)
        except untrusted.BadMessage as exc:
            raise ProtocolError(str(exc)) from None
        if not isinstance(header.get("op"), str) or \
                not isinstance(header.get("fields"), dict) or not isinstance(header.get("tensors"), list):
            raise ProtocolError("header must be an object with 'op', 'fields' and 'tensors'")
        specs = header["tensors"]
        if len(specs) > MAX_TENSORS or len(specs) != len(frames) - 1:
            raise ProtocolError(f"header declares {len(specs)} tensor(s), {len(frames) - 1} frame(s) came "
                                f"(at most {MAX_TENSORS})")
        tensors = [_tensor(spec, frame) for spec, frame in zip(specs, frames[1:])]
        return cls(header["op"], header["fields"], tensors)

    # -- typed access: each raises ProtocolError naming the field and what was expected --------
    def int(self, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
        v = self.fields.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise ProtocolError(f"{self.op}.{name} = {v!r}; expected an integer in [{lo}, {hi}]")
        return v

    def float(self, name: str) -> float:
        v = self.fields.get(name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ProtocolError(f"{self.op}.{name} = {v!r}; expected a finite number")
        return float(v)

    def str(self, name: str, max_len: int = 256) -> str:
        v = self.fields.get(name)
        if not isinstance(v, str) or len(v) > max_len:
            raise ProtocolError(f"{self.op}.{name} = {v!r:.80}; expected a string of at most {max_len} characters")
        return v

    def ranges(self, name: str, lo: int, hi: int, max_count: int = 1 << 16) -> list[tuple[int, int]]:
        """A list of disjoint, sorted, non-empty [start, end) ranges inside [lo, hi)."""
        v = self.fields.get(name)
        if not isinstance(v, list) or len(v) > max_count:
            raise ProtocolError(f"{self.op}.{name}: expected a list of at most {max_count} ranges")
        out, prev = [], lo
        for r in v:
            if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                    or not prev <= r[0] < r[1] <= hi):
                raise ProtocolError(f"{self.op}.{name}: range {r!r} is not sorted, disjoint and inside [{lo}, {hi})")
            out.append((r[0], r[1]))
            prev = r[1]
        return out

    def tensor(self, index: int, dtype: torch.dtype, shape: Iterable[int], finite: bool = False) -> torch.Tensor:
        """Tensor ``index``, which must have exactly ``dtype`` and ``shape`` (and no NaN or inf)."""
        if index >= len(self.tensors):
            raise ProtocolError(f"{self.op}: tensor {index} missing")
        t, shape = self.tensors[index], tuple(shape)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ProtocolError(f"{self.op}: tensor {index} is {_NAMES.get(t.dtype)}{list(t.shape)}; "
                                f"expected {_NAMES[dtype]}{list(shape)}")
        if finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ProtocolError(f"{self.op}: tensor {index} holds NaN or inf")
        return t


def _tensor(spec: Any, frame: bytes) -> torch.Tensor:
    if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str) or spec["dtype"] not in DTYPES \
            or not isinstance(spec.get("shape"), list):
        raise ProtocolError(f"tensor spec {spec!r:.80}; expected dtype in {sorted(DTYPES)} and a shape")
    shape = spec["shape"]
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 31 for d in shape):
        raise ProtocolError(f"tensor shape {shape!r:.80}; expected at most {MAX_DIMS} non-negative dimensions")
    dtype = DTYPES[spec["dtype"]]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes != len(frame):
        raise ProtocolError(f"tensor {spec['dtype']}{shape} needs {nbytes} bytes, its frame has {len(frame)}")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(frame), dtype=dtype).reshape(shape)
