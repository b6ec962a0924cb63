"""Numerical comparison of an op's output against a reference output, with tolerances per
op and dtype."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Tuple, Union

import torch

from ditorch.tools.op_selection import compile_patterns, matches

Tolerance = Tuple[float, float]  # (rtol, atol)
ToleranceSpec = Mapping[str, Union[Tolerance, Mapping[torch.dtype, Tolerance]]]

# (rtol, atol) by the dtype of the output under test. torch.testing's defaults for
# half/bfloat16/float64; float32 is looser than torch.testing (1.3e-6) because the reference
# is usually float64 and fp32 reductions over a few thousand terms drift ~1e-6 relative.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.complex64: (1e-5, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def _check_tolerance(value: object, where: str) -> Tolerance:
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(v, (int, float)) and v >= 0 for v in value)):
        raise ValueError(f"tolerance for {where}: expected (rtol, atol) with non-negative numbers, got {value!r}")
    return float(value[0]), float(value[1])


class Tolerances:
    """``{op pattern: (rtol, atol)}`` or ``{op pattern: {dtype: (rtol, atol)}}``; the first
    pattern matching the op (see ``op_selection``) and the output dtype wins, else
    ``DEFAULT_TOLERANCES``. Integer and bool outputs must match exactly."""

    def __init__(self, spec: Optional[ToleranceSpec] = None):
        self._rules: list[tuple] = []
        for pattern, value in (spec or {}).items():
            regex = compile_patterns(pattern, "tolerances")
            if isinstance(value, Mapping):
                per_dtype = {}
                for dtype, tol in value.items():
                    if not isinstance(dtype, torch.dtype):
                        raise TypeError(f"tolerances[{pattern!r}]: keys must be torch dtypes, got {dtype!r}")
                    per_dtype[dtype] = _check_tolerance(tol, f"{pattern!r}/{dtype}")
                self._rules.append((regex, per_dtype, None))
            else:
                self._rules.append((regex, None, _check_tolerance(value, repr(pattern))))
        self._cache: dict = {}

    def lookup(self, func: torch._ops.OpOverload, dtype: torch.dtype) -> Tolerance:
        key = (func, dtype)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._find(func, dtype)
            self._cache[key] = hit
        return hit

    def _find(self, func, dtype) -> Tolerance:
        for regex, per_dtype, every in self._rules:
            if matches(regex, func):
                if every is not None:
                    return every
                if dtype in per_dtype:
                    return per_dtype[dtype]
        return DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))


@dataclasses.dataclass
class Difference:
    """How far ``actual`` is from ``reference``. Relative error is |a-r|/|r| over elements
    with r != 0; cosine similarity is over elements finite in both (1.0 for two zero vectors)."""

    max_abs_err: float
    max_rel_err: float
    cosine: float
    allclose: bool
    detail: str = ""


def compare(actual: torch.Tensor, reference: torch.Tensor, rtol: float, atol: float) -> Difference:
    if actual.shape != reference.shape:
        return Difference(math.inf, math.inf, math.nan, False,
                          f"shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    a = actual.detach().to("cpu")
    r = reference.detach().to("cpu")
    if a.is_complex() or r.is_complex():
        a, r = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(r.to(torch.complex128))
    a, r = a.to(torch.float64), r.to(torch.float64)
    if a.numel() == 0:
        return Difference(0.0, 0.0, 1.0, True)
    exact = not (actual.is_floating_point() or actual.is_complex())
    if exact:
        rtol = atol = 0.0
    allclose = bool(torch.allclose(a, r, rtol=rtol, atol=atol, equal_nan=True))
    both_nan = torch.isnan(a) & torch.isnan(r)
    same_inf = torch.isinf(a) & (a == r)
    finite = torch.isfinite(a) & torch.isfinite(r)
    nonfinite_mismatch = bool((~(finite | both_nan | same_inf)).any())
    diff = (a - r).abs()[finite]
    max_abs = math.inf if nonfinite_mismatch else (float(diff.max()) if diff.numel() else 0.0)
    rmask = finite & (r != 0)
    rel = ((a - r).abs()[rmask] / r.abs()[rmask])
    max_rel = math.inf if nonfinite_mismatch else (float(rel.max()) if rel.numel() else 0.0)
    af, rf = a[finite], r[finite]
    na, nr = float(af.norm()), float(rf.norm())
    if na == 0.0 and nr == 0.0:
        cosine = 1.0
    elif na == 0.0 or nr == 0.0:
        cosine = 0.0
    else:
        cosine = float((af @ rf) / (na * nr))
    detail = "non-finite values differ" if nonfinite_mismatch else ""
    return Difference(max_abs, max_rel, cosine, allclose, detail)
