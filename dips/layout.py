"""How a model's parameters are cut into layer units and spread over followers.

A *unit* is the indivisible communication item of the paper's Appendix A: the parameters of one
element of a numbered container (``layers.3``, ``model.layers.3``), or else of the module that
holds them (``embed``, ``model.embed_tokens``, ``model.norm``): a pipeline stage holds every
unit it has whole, wherever a wrapper like Hugging Face's ``model.`` puts its modules. Units
keep the order of ``named_parameters()``; followers own contiguous, even runs of units.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

WIRE_DTYPE = torch.bfloat16
# bounds of a layout read from the network (a cluster seeding the PS): far beyond real models
MAX_WIRE_TENSORS, MAX_WIRE_NAME, MAX_WIRE_DIMS, MAX_WIRE_NUMEL = 100_000, 512, 8, 1 << 42


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str
    tensors: tuple[TensorSpec, ...]


def unit_name(param_name: str) -> str:
    """The unit of parameter ``param_name`` (see the module's docstring)."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) if len(parts) > 1 else param_name


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    units: tuple[Unit, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelLayout":
        return cls.of_specs([(name, tuple(p.shape)) for name, p in model.named_parameters()])

    @classmethod
    def of_specs(cls, specs: list[tuple[str, tuple[int, ...]]]) -> "ModelLayout":
        """Units in order of first appearance; a unit's tensors sorted by name, so two builds of
        one model whose modules register parameters in another order (a pipeline stage's TP
        block and the plain block) agree on the layout and the wire order."""
        groups: dict[str, list[TensorSpec]] = {}
        for name, shape in specs:
            groups.setdefault(unit_name(name), []).append(TensorSpec(name, tuple(shape)))
        names = [t.name for ts in groups.values() for t in ts]
        if len(set(names)) != len(names):
            raise ValueError(f"{len(names) - len(set(names))} tensor names appear twice in the model's layout")
        return cls(tuple(Unit(n, tuple(sorted(t, key=lambda s: s.name))) for n, t in groups.items()))

    def to_wire(self) -> list[list]:
        """``[[name, shape], ...]``: what a cluster that seeds the PS sends, and metadata keeps."""
        return [[t.name, list(t.shape)] for u in self.units for t in u.tensors]

    @classmethod
    def from_wire(cls, specs) -> "ModelLayout":
        """The layout of :meth:`to_wire`'s form as read from the network: every field bounded
        before use, a bad one named."""
        if not isinstance(specs, list) or not 0 < len(specs) <= MAX_WIRE_TENSORS:
            raise ValueError(f"tensor specs: expected a list of 1..{MAX_WIRE_TENSORS} [name, shape] pairs")
        out, total = [], 0
        for item in specs:
            ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)
            if not ok or not 0 < len(item[0]) <= MAX_WIRE_NAME or len(item[1]) > MAX_WIRE_DIMS:
                raise ValueError(f"tensor spec {str(item)[:80]}: expected [name of 1..{MAX_WIRE_NAME} characters, "
                                 f"shape of at most {MAX_WIRE_DIMS} dimensions]")
            if not all(type(d) is int and 0 < d <= MAX_WIRE_NUMEL for d in item[1]):
                raise ValueError(f"tensor {item[0][:80]!r}: shape {item[1][:8]}; expected positive integer sizes")
            spec = TensorSpec(item[0], tuple(item[1]))
            total += spec.numel
            if total > MAX_WIRE_NUMEL:
                raise ValueError(f"tensor specs hold more than {MAX_WIRE_NUMEL} elements in all")
            out.append((spec.name, spec.shape))
        return cls.of_specs(out)

    @property
    def fingerprint(self) -> str:
        """Short hash of names and shapes: a client and the PS must agree on it."""
        text = json.dumps(self.to_wire())
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def max_message_bytes(self) -> int:
        """The largest frame the data flow carries (a unit in BF16), with room for headers: the
        ``MAXMSGSIZE`` of every data socket."""
        largest = max(sum(t.numel for t in u.tensors) for u in self.units) * WIRE_DTYPE.itemsize
        return largest + 64 * 1024

    def partition(self, n_followers: int) -> list[tuple[int, int]]:
        """Follower i owns units [start, stop): contiguous runs, balanced by bytes (the largest
        run as small as it can be), so a follower's traffic and memory do not depend on how the
        model happens to group its tensors."""
        sizes = [sum(t.numel for t in u.tensors) for u in self.units]
        n = len(sizes)
        if not 1 <= n_followers <= n:
            raise ValueError(f"{n_followers} followers for {n} layer units; expected 1..{n}")
        lo, hi = max(sizes), sum(sizes)
        while lo < hi:  # the smallest bound on a run's size that n_followers runs can meet
            mid = (lo + hi) // 2
            if _runs_needed(sizes, mid) <= n_followers:
                hi = mid
            else:
                lo = mid + 1
        bounds, start, run = [], 0, 0
        for i, size in enumerate(sizes):
            runs_after = n_followers - len(bounds) - 1  # runs still to open after this one
            if i > start and (run + size > lo or n - i <= runs_after):
                bounds.append((start, i))
                start, run = i, 0
            run += size
        bounds.append((start, n))
        return bounds

    def owner_of_units(self, n_followers: int) -> list[int]:
        dest = []
        for i, (a, b) in enumerate(self.partition(n_followers)):
            dest += [i] * (b - a)
        return dest


def pack_unit(tensors: list[torch.Tensor]) -> bytes:
    """Concatenate tensors as BF16 bytes, the wire format of the data flow."""
    flat = torch.cat([t.detach().reshape(-1).to(WIRE_DTYPE) for t in tensors])
    return flat.view(torch.int16).numpy().tobytes()


def unpack_unit(unit: Unit, payload: bytes | memoryview) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_unit`; raises ValueError on a payload of the wrong size."""
    expected = sum(t.numel for t in unit.tensors) * 2
    if len(payload) != expected:
        raise ValueError(f"unit {unit.name}: payload of {len(payload)} bytes; expected {expected}")
    flat = torch.frombuffer(bytearray(payload), dtype=WIRE_DTYPE)
    out, offset = {}, 0
    for spec in unit.tensors:
        out[spec.name] = flat[offset: offset + spec.numel].view(spec.shape)
        offset += spec.numel
    return out


def _runs_needed(sizes: list[int], bound: int) -> int:
    """How many contiguous runs of at most ``bound`` elements each, filled greedily, hold ``sizes``."""
    runs, run = 1, 0
    for size in sizes:
        if run + size > bound:
            runs, run = runs + 1, 0
        run += size
    return runs
