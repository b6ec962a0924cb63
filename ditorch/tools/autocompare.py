"""AutoCompare: run every selected op a second time on a reference device/dtype and compare."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ditorch.tools.capture import save_op_call
from ditorch.tools.comparison import ToleranceSpec, Tolerances, compare
from ditorch.tools.op_selection import OpPatterns
from ditorch.tools.tensors import hidden, op_results, to_host
from ditorch.tools.tool_mode import OpCall, ToolMode, logger, write_records


@dataclasses.dataclass
class OpComparison:
    """One result of one op call against its reference: ``output`` indexes the returned
    tensors, followed by tensors written in place and not returned (see ``op_results``)."""

    index: int
    op: str
    phase: str
    autograd_node: str
    output: int
    dtype: str
    shape: str
    max_abs_err: float
    max_rel_err: float
    cosine: float
    rtol: float
    atol: float
    allclose: bool
    detail: str = ""
    inputs_saved: str = ""


class MismatchError(AssertionError):
    """Raised at the op when ``autocompare(raise_on_mismatch=True)`` finds a mismatch."""

    def __init__(self, result: OpComparison):
        super().__init__(
            f"autocompare: {result.op} (op #{result.index}, {result.phase}"
            f"{' ' + result.autograd_node if result.autograd_node else ''}) output {result.output} "
            f"differs from the reference: max abs {result.max_abs_err:.3g}, max rel {result.max_rel_err:.3g}, "
            f"cosine {result.cosine:.6f} (rtol={result.rtol:g}, atol={result.atol:g})"
            f"{'; inputs saved to ' + result.inputs_saved if result.inputs_saved else ''}"
        )
        self.result = result


class autocompare(ToolMode):
    """Compare each selected op against the same op on ``reference`` at ``dtype``.

    The inputs are copied to the host before the op runs (in-place ops overwrite them), the op
    runs as usual and its result is what the program gets; then the copies are moved to
    ``reference`` (cast to ``dtype`` if given, floating tensors only) and the op runs there.
    Each tensor output yields an ``OpComparison`` in ``results``. Mismatching calls (allclose
    false under the per-op/dtype tolerance) are logged and, with ``out_dir``, their inputs and
    outputs are saved as captures (``ditorch replay`` re-runs them) under
    ``out_dir/mismatches/``; ``out_dir/autocompare.csv`` and ``.json`` get all results on exit.
    Random ops and ops returning uninitialized memory are skipped unless named in ``ops``.
    """

    skip_noncomparable = True

    def __init__(self, reference: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None,
                 ops: OpPatterns = None, skip: OpPatterns = None,
                 tolerances: Optional[ToleranceSpec] = None,
                 out_dir: Optional[str | os.PathLike] = "ditorch_tools_out",
                 raise_on_mismatch: bool = False, max_saved: int = 50):
        super().__init__(ops, skip)
        self.reference = torch.device(reference)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"autocompare: dtype must be a torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.tolerances = Tolerances(tolerances)
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.raise_on_mismatch = raise_on_mismatch
        self.max_saved = max_saved
        self.results: list[OpComparison] = []
        self._saved = 0

    @property
    def mismatches(self) -> list[OpComparison]:
        return [r for r in self.results if not r.allclose]

    def _to_reference(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        dtype = self.dtype if (self.dtype is not None and x.is_floating_point()) else x.dtype
        return x.to(device=self.reference, dtype=dtype, copy=True)

    def handle(self, func, args, kwargs, call: OpCall):
        with hidden():
            inputs = to_host((args, kwargs))
        out = func(*args, **kwargs)
        with hidden():
            self._compare(func, args, kwargs, out, inputs, call)
        return out

    def _compare(self, func, args, kwargs, out, inputs, call: OpCall) -> None:
        ref_args, ref_kwargs = tree_map(self._to_reference, inputs)
        try:
            ref_out = func(*ref_args, **ref_kwargs)
        except Exception as exc:  # the reference cannot run it (e.g. no float64 kernel)
            self.results.append(OpComparison(call.index, call.op, call.phase, call.node, -1, "", "",
                                             float("nan"), float("nan"), float("nan"), 0.0, 0.0, True,
                                             f"reference failed: {type(exc).__name__}: {exc}"))
            return
        actual = op_results(func, args, kwargs, out)
        expected = op_results(func, ref_args, ref_kwargs, ref_out)
        new = []
        for i, (a, r) in enumerate(zip(actual, expected)):
            rtol, atol = self.tolerances.lookup(func, a.dtype)
            d = compare(a, r, rtol, atol)
            new.append(OpComparison(call.index, call.op, call.phase, call.node, i, str(a.dtype).replace("torch.", ""),
                                    "x".join(map(str, a.shape)), d.max_abs_err, d.max_rel_err, d.cosine,
                                    rtol, atol, d.allclose, d.detail))
        self.results.extend(new)
        bad = [r for r in new if not r.allclose]
        if bad:
            saved = ""
            if self.out_dir is not None and self._saved < self.max_saved:
                self._saved += 1
                saved = str(save_op_call(self.out_dir / "mismatches" / call.label, func, call, inputs, actual,
                                         {"reference": str(self.reference), "reference_dtype": str(self.dtype)}))
            for r in bad:
                r.inputs_saved = saved
                logger.warning("%s", MismatchError(r))
            if self.raise_on_mismatch:
                raise MismatchError(bad[0])

    def finish(self) -> None:
        if self.out_dir is not None and self.results:
            write_records(self.results, self.out_dir / "autocompare.csv")
            write_records(self.results, self.out_dir / "autocompare.json")
        if self.results:
            logger.info("autocompare: %d outputs compared, %d mismatches", len(self.results), len(self.mismatches))
