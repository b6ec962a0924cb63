"""FlexAttention (``torch.nn.attention.flex_attention``) on dipu, eager and under torch.compile.

PyTorch has no registration point for a device's FlexAttention: ``flex_attention`` refuses any
device outside a fixed set (``_validate_device``), and its higher-order op runs either a fused
kernel (Triton for CUDA/XPU, Inductor's C++ template for CPU inference) or, eagerly, a dense
"math" implementation with a hand-written backward op. ditorch makes two changes, both when
the module is first imported (``ditorch_ext.inductor``'s post-import hook):

- the device check accepts dipu (with backward: unlike the CPU's, dipu's path has one);
- the higher-order op gets a kernel for ``AutogradPrivateUse1`` (dipu tensors) that runs
  PyTorch's own dense math (``math_attention``: scores in fp32, or fp64 for fp64 inputs, the
  score_mod and mask_mod vmapped over them, a safe softmax, the product with V) as ordinary
  differentiable ops. Eagerly, autograd differentiates those ops; under torch.compile,
  AOTAutograd traces them into the joint graph, so Inductor compiles plain ATen ops for dipu
  (its C++ backend and the shim's extern kernels) instead of meeting a higher-order op it has no
  dipu lowering for. The BlockMask's block sparsity is not used to skip work: the mask_mod is
  applied to the full score matrix, as PyTorch's math path does.

On an emulated chip a call is charged as one fused attention kernel, as a vendor's FlexAttention
kernel would be: its dense ops run uncharged and the whole is charged as
``_scaled_dot_product_flash_attention_for_cpu`` (forward) and its ``_backward`` on the same
q, k, v (KernelCosts.h: the attention FLOPs, the bytes of q, k, v and the output, no score
matrix). For that the eager call keeps its inputs and recomputes the scores in its backward, as
a flash kernel does. Under torch.compile the dense ops are traced into the graph and charged as
Inductor's kernels are (docs/compile.md).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

def _dipu_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable,
                         block_mask: tuple, scale: float, kernel_options: dict[str, Any],
                         score_mod_other_buffers: tuple = (), mask_mod_other_buffers: tuple = ()) -> tuple:
    """The flex_attention higher-order op on dipu tensors: PyTorch's dense implementation, its
    ops differentiable (out, and the logsumexp and max scores in log2 units as the op returns them).
    Eagerly on an emulated chip, charged as one attention kernel; traced (torch.compile: the
    tensors are functional or fake), its ops go into the graph."""
    from ditorch_ext import _C

    eager = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (query, key, value))
    if eager and _C.chip_slowdown() > 0:
        return _ChargedAsAttention.apply(query, key, value, score_mod, block_mask, scale, kernel_options,
                                         mask_mod_other_buffers, *score_mod_other_buffers)
    return _dense(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers,
                  mask_mod_other_buffers)


_FORWARD = "aten::_scaled_dot_product_flash_attention_for_cpu"
_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"


class _Uncharged:
    """This thread's kernels go uncharged on the emulated chip while inside."""

    def __enter__(self) -> None:
        from ditorch_ext import _C

        self.was = _C.set_kernels_uncharged(True)

    def __exit__(self, *exc: Any) -> None:
        from ditorch_ext import _C

        _C.set_kernels_uncharged(self.was)


class _ChargedAsAttention(torch.autograd.Function):
    """One eager FlexAttention call on an emulated chip: the dense ops uncharged, the forward and
    the backward each charged as one attention kernel; the backward recomputes the scores."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable,
                block_mask: tuple, scale: float, kernel_options: dict, mask_mod_other_buffers: tuple,
                *score_mod_other_buffers: torch.Tensor) -> tuple:
        from ditorch_ext import _C

        with _Uncharged():
            out, lse, max_scores = _dense(query, key, value, score_mod, block_mask, scale, kernel_options,
                                          score_mod_other_buffers, mask_mod_other_buffers)
        _C.charge_as(_FORWARD, [query, key, value])
        ctx.call = (score_mod, block_mask, scale, kernel_options, mask_mod_other_buffers)
        ctx.save_for_backward(query, key, value, out, *score_mod_other_buffers)
        ctx.mark_non_differentiable(max_scores)
        ctx.set_materialize_grads(False)  # an unused logsumexp costs no zeros kernel
        return out, lse, max_scores

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor, _grad_max: Any) -> tuple:
        from ditorch_ext import _C

        query, key, value, out, *buffers = ctx.saved_tensors
        score_mod, block_mask, scale, kernel_options, mask_mod_other_buffers = ctx.call
        with _Uncharged(), torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in (query, key, value, *buffers)]
            again, lse, _ = _dense(*leaves[:3], score_mod, block_mask, scale, kernel_options, tuple(leaves[3:]),
                                   mask_mod_other_buffers)
            outputs, grads = [again], [grad_out if grad_out is not None else torch.zeros_like(again)]
            if grad_lse is not None:
                outputs.append(lse)
                grads.append(grad_lse)
            found = torch.autograd.grad(outputs, [t for t in leaves if t.requires_grad], grads, allow_unused=True)
        _C.charge_as(_BACKWARD, [grads[0], query, key, value, out])
        by_leaf = iter(found)
        per_input = [next(by_leaf) if t.requires_grad else None for t in (query, key, value, *buffers)]
        return (*per_input[:3], None, None, None, None, None, *per_input[3:])


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable, block_mask: tuple,
           scale: float, kernel_options: dict, score_mod_other_buffers: tuple, mask_mod_other_buffers: tuple) -> tuple:
    from torch._higher_order_ops.flex_attention import _permute_strides, math_attention

    out, lse, max_scores = math_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                                          score_mod_other_buffers, mask_mod_other_buffers)
    return _permute_strides(out, query.stride()), lse, max_scores


def register() -> None:
    """Accept dipu in flex_attention's device check and give its higher-order op a dipu kernel
    (idempotent; run once the module is imported)."""
    import torch.nn.attention.flex_attention as flex
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op

    if getattr(flex._validate_device, "_dipu", False):
        return
    torch_validate_device = flex._validate_device

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type != "dipu":
            torch_validate_device(query, key, value)

    validate_device._dipu = True  # type: ignore[attr-defined]
    flex._validate_device = validate_device
    if DispatchKey.AutogradPrivateUse1 not in flex_attention_op.py_kernels:
        flex_attention_op.py_impl(DispatchKey.AutogradPrivateUse1)(_dipu_flex_attention)
