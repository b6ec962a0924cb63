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
    tensors, followed by tensors written in place and not returned (see ``op_results``).

    ``status`` is ``match`` or ``mismatch`` (within tolerance or not), ``missing`` (one run
    returned this output, the other did not) or ``reference failed`` (the reference could not
    run the op, ``output`` -1: nothing was compared, so it is never counted as agreeing)."""

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
    status: str
    detail: str = ""
    inputs_saved: str = ""


class MismatchError(AssertionError):
    """Raised at the op when ``autocompare(raise_on_mismatch=True)`` finds a mismatch."""

    def __init__(self, result: OpComparison):
        where = (f"autocompare: {result.op} (op #{result.index}, {result.phase}"
                 f"{' ' + result.autograd_node if result.autograd_node else ''}) output {result.output}")
        if result.status == "missing":
            what = f": {result.detail}"
        else:
            what = (f" differs from the reference: max abs {result.max_abs_err:.3g}, max rel {result.max_rel_err:.3g}, "
                    f"cosine {result.cosine:.6f} (rtol={result.rtol:g}, atol={result.atol:g})")
        saved = f"; inputs saved to {result.inputs_saved}" if result.inputs_saved else ""
        super().__init__(where + what + saved)
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
        self._unchecked_ops: set[str] = set()

    @property
    def mismatches(self) -> list[OpComparison]:
        """Outputs that differ from the reference, or that only one run returned."""
        return [r for r in self.results if r.status in ("mismatch", "missing")]

    @property
    def unchecked(self) -> list[OpComparison]:
        """Calls the reference could not run: nothing was compared."""
        return [r for r in self.results if r.status == "reference failed"]

    def _to_reference(self, x):
        if isinstance(x, torch.device):  # a factory op's device= runs on the reference too
            return self.reference
        if not isinstance(x, torch.Tensor):
            return x
        dtype = self.dtype if (self.dtype is not None and x.is_floating_point()) else x.dtype
        return x.to(device=self.reference, dtype=dtype, copy=True)

    def _reference_inputs(self, inputs):
        args, kwargs = tree_map(self._to_reference, inputs)
        if self.dtype is not None and isinstance(kwargs.get("dtype"), torch.dtype) and kwargs["dtype"].is_floating_point:
            kwargs = {**kwargs, "dtype": self.dtype}  # a floating factory op at the reference dtype
        return args, kwargs

    def handle(self, func, args, kwargs, call: OpCall):
        with hidden():
            inputs = to_host((args, kwargs))
        out = func(*args, **kwargs)
        with hidden():
            self._compare(func, args, kwargs, out, inputs, call)
        return out

    def _compare(self, func, args, kwargs, out, inputs, call: OpCall) -> None:
        ref_args, ref_kwargs = self._reference_inputs(inputs)
        try:
            ref_out = func(*ref_args, **ref_kwargs)
        except Exception as exc:  # the reference cannot run it (e.g. no float64 kernel)
            result = self._record(call, -1, None, "reference failed", f"{type(exc).__name__}: {exc}")
            if call.op not in self._unchecked_ops:  # once per op: a training loop repeats it
                self._unchecked_ops.add(call.op)
                logger.warning("autocompare: %s not compared (the reference %s could not run it: %s)",
                               call.op, self.reference, result.detail)
            return
        actual = op_results(func, args, kwargs, out)
        expected = op_results(func, ref_args, ref_kwargs, ref_out)
        new = []
        for i in range(max(len(actual), len(expected))):
            if i >= len(actual) or i >= len(expected):
                present = actual[i] if i < len(actual) else expected[i]
                side = "the device" if i < len(actual) else "the reference"
                new.append(self._record(call, i, present, "missing", f"only {side} returned output {i}"))
                continue
            a, r = actual[i], expected[i]
            rtol, atol = self.tolerances.lookup(func, a.dtype)
            d = compare(a, r, rtol, atol)
            new.append(self._record(call, i, a, "match" if d.allclose else "mismatch", d.detail, d, rtol, atol))
        bad = [r for r in new if r.status != "match"]
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

    def _record(self, call: OpCall, output: int, tensor: Optional[torch.Tensor], status: str, detail: str,
                diff=None, rtol: float = 0.0, atol: float = 0.0) -> OpComparison:
        nan = float("nan")
        result = OpComparison(
            call.index, call.op, call.phase, call.node, output,
            "" if tensor is None else str(tensor.dtype).replace("torch.", ""),
            "" if tensor is None else "x".join(map(str, tensor.shape)),
            nan if diff is None else diff.max_abs_err, nan if diff is None else diff.max_rel_err,
            nan if diff is None else diff.cosine, rtol, atol, status == "match", status, detail)
        self.results.append(result)
        return result

    def finish(self) -> None:
        if self.out_dir is not None and self.results:
            write_records(self.results, self.out_dir / "autocompare.csv")
            write_records(self.results, self.out_dir / "autocompare.json")
        if self.results:
            logger.info("autocompare: %d outputs compared, %d mismatches, %d calls the reference could not run",
                        len(self.results) - len(self.unchecked), len(self.mismatches), len(self.unchecked))
