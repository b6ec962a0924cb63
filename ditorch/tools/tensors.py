"""Tensor plumbing shared by the tools: layout-exact copies, bitwise equality, and running an
op on converted inputs (another dtype or device) with outputs and in-place writes put back."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils._python_dispatch import _disable_current_modes

Tensor = torch.Tensor


def hidden():
    """Context for a tool's own work (copies, reference runs, checks): every dispatch mode is
    taken off the stack meanwhile, so tools nested around this one see only the program's
    ops, not the tool's."""
    return _disable_current_modes()


def is_dense(t: Tensor) -> bool:
    """True when the strides of ``t`` cover its elements exactly once with no gaps (a permuted
    contiguous layout), so ``empty_strided(size, stride)`` can hold an exact copy."""
    dims = [(st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1]
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            return False
        expected *= size
    return True


def copy_with_layout(t: Tensor, device: torch.device | str) -> Tensor:
    """A copy of ``t`` on ``device`` with the same sizes and strides (dense layouts), so a
    kernel that picks its algorithm by layout (BLAS transposes) sees the same operand.
    Overlapping or gapped views are copied contiguous."""
    if t.layout != torch.strided:
        return t.to(device, copy=True)
    if is_dense(t):
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        out.copy_(t)
        return out
    return t.contiguous().to(device, copy=True)


def to_host(tree: Any) -> Any:
    """Layout-exact CPU copies of every tensor in a pytree (other leaves unchanged)."""
    return tree_map(lambda x: copy_with_layout(x.detach(), "cpu") if isinstance(x, Tensor) else x, tree)


def tensors_of(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.is_floating_point() or a.is_complex():
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if a.is_complex():
            a, b = torch.view_as_real(a).contiguous(), torch.view_as_real(b).contiguous()
        int_dtype = as_int[a.element_size()]
        return torch.equal(a.view(int_dtype), b.view(int_dtype))
    return torch.equal(a, b)


def _mutated_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[Any, Any]:
    """alias set -> argument (a tensor or a list of tensors) that ``func`` writes to
    (in-place, ``out=`` and ``_foreach_*_`` ops)."""
    written: dict[Any, Any] = {}
    for position, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[position] if position < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        if isinstance(value, Tensor) or (isinstance(value, (list, tuple)) and value
                                         and all(isinstance(v, Tensor) for v in value)):
            written[frozenset(info.before_set)] = value
    return written


def op_results(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> list[Tensor]:
    """What a call produced: its returned tensors, then the tensors it wrote in place that it
    did not return (``_foreach_add_`` returns nothing). Call after the op ran."""
    results = tensors_of(out)
    seen = {id(t) for t in results}
    for value in _mutated_arguments(func, args, kwargs).values():
        for t in ([value] if isinstance(value, Tensor) else value):
            if id(t) not in seen:
                seen.add(id(t))
                results.append(t)
    return results


def run_converted(
    func: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    convert: Callable[[Tensor], Optional[Tensor]],
    restore: Callable[[Tensor], Tensor],
    convert_leaf: Callable[[Any], Any] = lambda x: x,
) -> Any:
    """Run ``func`` on converted inputs and hand back results as the caller expects them.

    ``convert(t)`` returns the tensor to run with, or None to pass ``t`` unchanged;
    ``convert_leaf`` rewrites non-tensor arguments (e.g. a ``device=`` kwarg). Fresh outputs
    go through ``restore``; tensors the op writes (in-place, ``out=``) get the new values
    copied back into the caller's tensor, which is what the op returns for them.
    """
    def conv(x: Any) -> Any:
        if isinstance(x, Tensor):
            y = convert(x)
            return x if y is None else y
        return convert_leaf(x)

    # Conversions are the tool's work, hidden from other dispatch modes; the op itself is not.
    with hidden():
        new_args, new_kwargs = tree_map(conv, (args, kwargs))
    out = func(*new_args, **new_kwargs)
    with hidden():
        return _results_back(func, args, kwargs, new_args, new_kwargs, out, restore)


def _results_back(func, args, kwargs, new_args, new_kwargs, out, restore) -> Any:
    originals = _mutated_arguments(func, args, kwargs)
    if not originals:
        return tree_map(lambda x: restore(x) if isinstance(x, Tensor) else x, out)
    converted = _mutated_arguments(func, new_args, new_kwargs)
    for alias, original in originals.items():
        pairs = zip([original], [converted[alias]]) if isinstance(original, Tensor) else zip(original, converted[alias])
        for dst, src in pairs:
            if dst is not src:
                dst.copy_(src)
    flat, spec = tree_flatten(out)
    returns = func._schema.returns
    fixed = []
    for i, value in enumerate(flat):
        info = returns[i].alias_info if i < len(returns) and len(flat) == len(returns) else None
        alias = frozenset(info.before_set) if info is not None else None
        if alias in originals:
            fixed.append(originals[alias])
        else:
            fixed.append(restore(value) if isinstance(value, Tensor) else value)
    return tree_unflatten(fixed, spec)
