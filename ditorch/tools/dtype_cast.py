"""DtypeCast: run chosen ops in another dtype (e.g. bf16 softmax computed in fp32)."""
from __future__ import annotations

from typing import Mapping

import torch

from ditorch.tools.op_selection import OpPatterns
from ditorch.tools.tensors import run_converted
from ditorch.tools.tool_mode import OpCall, ToolMode


class dtype_cast(ToolMode):
    """For each selected op, cast floating inputs whose dtype is a key of ``mapping`` to the
    mapped dtype, run the op, and cast outputs of a mapped-to dtype back to the source dtype
    (in-place ops write back into the caller's tensor). ``calls`` counts the ops cast.
    Tells whether a mismatch comes from an op's precision: if casting it to fp32 fixes it,
    it did."""

    def __init__(self, mapping: Mapping[torch.dtype, torch.dtype], ops: OpPatterns = None,
                 skip: OpPatterns = None):
        super().__init__(ops, skip)
        if not isinstance(mapping, Mapping) or not mapping:
            raise ValueError(f"dtype_cast: expected a non-empty {{source dtype: target dtype}} mapping, got {mapping!r}")
        for src, dst in mapping.items():
            if not (isinstance(src, torch.dtype) and isinstance(dst, torch.dtype)):
                raise TypeError(f"dtype_cast: mapping entries must be torch dtypes, got {src!r}: {dst!r}")
        self.mapping = dict(mapping)
        self.calls = 0

    def handle(self, func, args, kwargs, call: OpCall):
        cast_from: dict[torch.dtype, torch.dtype] = {}  # target -> source, for this call

        def convert(t: torch.Tensor):
            target = self.mapping.get(t.dtype)
            if target is None or target == t.dtype:
                return None
            cast_from.setdefault(target, t.dtype)
            return t.to(target)

        def restore(t: torch.Tensor) -> torch.Tensor:
            source = cast_from.get(t.dtype)
            return t if source is None else t.to(source)

        out = run_converted(func, args, kwargs, convert, restore)
        if cast_from:
            self.calls += 1
        return out
