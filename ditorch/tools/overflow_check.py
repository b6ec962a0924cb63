"""OverflowCheck: find the first op that produces inf or NaN."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from ditorch.tools.capture import save_op_call
from ditorch.tools.op_selection import OpPatterns
from ditorch.tools.tensors import hidden, op_results, tensors_of, to_host
from ditorch.tools.tool_mode import OpCall, ToolMode, logger


@dataclasses.dataclass
class TensorStats:
    """Summary of one tensor: finite min/max/absmax/mean and non-finite counts."""

    shape: tuple
    dtype: str
    min: float
    max: float
    absmax: float
    mean: float
    n_nan: int
    n_inf: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorStats":
        x = t.detach().to("cpu")
        n_nan = n_inf = 0
        if x.is_floating_point():
            n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            x = x[torch.isfinite(x)]
        x = x.to(torch.float64)
        if x.numel() == 0:
            return cls(tuple(t.shape), str(t.dtype), math.nan, math.nan, math.nan, math.nan, n_nan, n_inf)
        return cls(tuple(t.shape), str(t.dtype), float(x.min()), float(x.max()), float(x.abs().max()),
                   float(x.mean()), n_nan, n_inf)

    def __str__(self) -> str:
        return (f"{self.dtype.replace('torch.', '')}{list(self.shape)} min={self.min:.4g} max={self.max:.4g} "
                f"absmax={self.absmax:.4g} mean={self.mean:.4g} nan={self.n_nan} inf={self.n_inf}")


@dataclasses.dataclass
class Overflow:
    """An op whose outputs hold a kind of non-finite value (inf or NaN) its inputs lacked."""

    index: int
    op: str
    phase: str
    autograd_node: str
    inputs: list[TensorStats]
    outputs: list[TensorStats]
    inputs_saved: str = ""

    def __str__(self) -> str:
        where = f"{self.phase}{' ' + self.autograd_node if self.autograd_node else ''}"
        lines = [f"overflow_check: {self.op} (op #{self.index}, {where}) produced non-finite values"]
        lines += [f"  input {i}: {s}" for i, s in enumerate(self.inputs)]
        lines += [f"  output {i}: {s}" for i, s in enumerate(self.outputs)]
        if self.inputs_saved:
            lines.append(f"  inputs saved to {self.inputs_saved}")
        return "\n".join(lines)


class NonFiniteError(FloatingPointError):
    """Raised at the first op producing inf/NaN (``overflow_check(on_overflow='raise')``)."""

    def __init__(self, overflow: Overflow):
        super().__init__(str(overflow))
        self.overflow = overflow


def _nonfinite_kinds(tree: Any) -> tuple[bool, bool]:
    """(has NaN, has inf) over the floating tensors and Python floats of a pytree."""
    has_nan = has_inf = False
    for x in tree_flatten(tree)[0]:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() or x.is_complex():
                has_nan = has_nan or bool(torch.isnan(x).any())
                has_inf = has_inf or bool(torch.isinf(x).any())
        elif isinstance(x, float):
            has_nan = has_nan or math.isnan(x)
            has_inf = has_inf or math.isinf(x)
    return has_nan, has_inf


class overflow_check(ToolMode):
    """Check the outputs of every selected op for inf/NaN.

    An op is reported when its outputs contain NaN while no input did, or inf while no input
    did: masking with ``-inf`` or a softmax over masked scores is not an overflow, an op
    creating the first inf or NaN is. ``on_overflow='raise'`` (default) stops there with
    ``NonFiniteError``; ``'record'`` collects every such op in ``overflows`` and goes on.
    With ``out_dir`` the offending op's inputs are saved as a replayable capture.
    """

    def __init__(self, ops: OpPatterns = None, skip: OpPatterns = None, on_overflow: str = "raise",
                 out_dir: Optional[str | os.PathLike] = None):
        super().__init__(ops, skip)
        if on_overflow not in ("raise", "record"):
            raise ValueError(f"overflow_check: on_overflow must be 'raise' or 'record', got {on_overflow!r}")
        self.on_overflow = on_overflow
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.overflows: list[Overflow] = []

    def handle(self, func, args, kwargs, call: OpCall):
        # In-place ops overwrite their inputs: copy those before the op runs. Other ops are
        # checked after the fact, which keeps the common path at one isfinite test per output.
        mutable = func._schema.is_mutable
        with hidden():
            inputs = to_host((args, kwargs)) if mutable else None
            before = _nonfinite_kinds(inputs) if mutable else None
        out = func(*args, **kwargs)
        with hidden():
            self._check(func, args, kwargs, out, inputs, before, call)
        return out

    def _check(self, func, args, kwargs, out, inputs, before, call: OpCall) -> None:
        mutable = inputs is not None
        results = op_results(func, args, kwargs, out) if mutable else out
        out_nan, out_inf = _nonfinite_kinds(results)
        if not (out_nan or out_inf):
            return
        in_nan, in_inf = before if before is not None else _nonfinite_kinds((args, kwargs))
        if (out_nan and not in_nan) or (out_inf and not in_inf):
            found = Overflow(call.index, call.op, call.phase, call.node,
                             [TensorStats.of(t) for t in tensors_of(inputs if inputs is not None else (args, kwargs))],
                             [TensorStats.of(t) for t in tensors_of(results)])
            if self.out_dir is not None:
                found.inputs_saved = str(save_op_call(self.out_dir / "overflows" / call.label, func, call,
                                                      inputs if inputs is not None else to_host((args, kwargs)), tensors_of(results)))
            self.overflows.append(found)
            logger.warning("%s", found)
            if self.on_overflow == "raise":
                raise NonFiniteError(found)
