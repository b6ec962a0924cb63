"""Which ATen ops a tool acts on: names and regular expressions matched against op names.

A pattern is matched (``re.fullmatch``) against every name an op answers to:

* its overload name ``aten::addmm.default`` and ``aten.addmm.default``, its packet name
  ``addmm`` and ``aten.addmm``;
* the packet name without leading underscores and a ``native_`` prefix (``_softmax`` ->
  ``softmax``, ``native_layer_norm`` -> ``layer_norm``), and without a ``_backward`` /
  ``_backward_data`` suffix, so ``softmax`` also selects ``_softmax_backward_data``;
* the public function names that decompose into it before reaching ATen's dispatcher
  (``matmul`` and ``linear`` never reach a dispatch mode: they arrive as ``mm``, ``bmm``,
  ``addmm``...), listed in ``FAMILIES``.
"""
from __future__ import annotations

import re
from typing import Iterable, Union

import torch

OpPatterns = Union[str, Iterable[str], None]

# Composite (CompositeImplicitAutograd) functions -> the ATen ops they arrive as.
FAMILIES: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "dot", "addmv"),
    "linear": ("mm", "addmm", "bmm"),
    "conv": ("convolution", "convolution_backward"),
    "attention": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"),
}
_FAMILY_OF: dict[str, tuple[str, ...]] = {}
for _family, _members in FAMILIES.items():
    for _member in _members:
        _FAMILY_OF[_member] = _FAMILY_OF.get(_member, ()) + (_family,)


def op_names(func: torch._ops.OpOverload) -> tuple[str, ...]:
    """Every name ``func`` answers to (see the module docstring)."""
    packet = func._opname
    ns = func.namespace
    names = [func.name(), f"{ns}::{packet}.{func._overloadname}", f"{ns}.{packet}.{func._overloadname}",
             packet, f"{ns}.{packet}", f"{ns}::{packet}"]
    base = packet.lstrip("_")
    if base.startswith("native_"):
        base = base[len("native_"):]
    names.append(base)
    for suffix in ("_backward_data", "_backward_input", "_backward"):
        if base.endswith(suffix):
            names.append(base[: -len(suffix)])
            break
    names.extend(_FAMILY_OF.get(packet, ()))
    return tuple(dict.fromkeys(names))


def compile_patterns(patterns: OpPatterns, what: str = "ops") -> re.Pattern | None:
    """One regex from a pattern string or a list of them; None means 'no pattern'."""
    if patterns is None:
        return None
    if isinstance(patterns, str):
        parts = [patterns]
    else:
        parts = list(patterns)
        if not all(isinstance(p, str) for p in parts):
            raise TypeError(f"{what}: expected a regex string or a list of strings, got {patterns!r}")
    if not parts or any(not p.strip() for p in parts):
        raise ValueError(f"{what}: empty op pattern in {patterns!r}; expected e.g. 'mm|addmm' or ['softmax']")
    joined = "|".join(f"(?:{p.strip()})" for p in parts)
    try:
        return re.compile(joined)
    except re.error as exc:
        raise ValueError(f"{what}: {patterns!r} is not a valid regular expression: {exc}") from None


def matches(pattern: re.Pattern, func: torch._ops.OpOverload) -> bool:
    return any(pattern.fullmatch(name) for name in op_names(func))


# Ops whose outputs are not a function of their inputs: comparing or replaying them is noise.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}


def is_noncomparable(func: torch._ops.OpOverload) -> bool:
    """Random ops and ops returning uninitialized memory."""
    return torch.Tag.nondeterministic_seeded in func.tags or func._opname in _UNINITIALIZED


class OpSelector:
    """Decides, once per op overload (cached), whether a tool acts on it.

    View ops (``func.is_view``) are never selected: they compute nothing and moving or
    recomputing them would break aliasing. ``skip_noncomparable`` also drops random ops and
    ops returning uninitialized memory unless ``ops`` names them explicitly.
    """

    def __init__(self, ops: OpPatterns = None, skip: OpPatterns = None, *, skip_noncomparable: bool = False):
        self.ops = compile_patterns(ops, "ops")
        self.skip = compile_patterns(skip, "skip")
        self.skip_noncomparable = skip_noncomparable
        self._cache: dict[torch._ops.OpOverload, bool] = {}

    def __call__(self, func: torch._ops.OpOverload) -> bool:
        hit = self._cache.get(func)
        if hit is None:
            hit = self._decide(func)
            self._cache[func] = hit
        return hit

    def _decide(self, func: torch._ops.OpOverload) -> bool:
        if func.is_view:
            return False
        if self.skip is not None and matches(self.skip, func):
            return False
        if self.ops is not None:
            return matches(self.ops, func)
        return not (self.skip_noncomparable and is_noncomparable(func))
