"""What the OpInfo sweep on dipu (tests/device/opinfo_sweep.py) is expected not to agree on, and why.

Every entry names one OpInfo (``name`` or ``name.variant``) and says specifically why its dipu run
does not match its CPU run. The test fails when an op fails that is not listed here (a shim
regression) and when a listed op passes (a stale entry), so this file is the exact list.
"""
from __future__ import annotations

# Ops whose forward result on dipu does not agree with CPU.
_SPARSE_INPUT = (
    "compressed sparse layouts are refused on dipu (csrc/device/SparseOps.cpp; only sparse COO is "
    "supported): the sample's CSR input makes aten::{} raise NotImplementedError naming the layout"
)

FORWARD_FAILURES: dict[str, str] = {
    "sparse.mm.reduce": _SPARSE_INPUT.format("_sparse_mm_reduce_impl"),
    "sparse.sampled_addmm": _SPARSE_INPUT.format("sparse_sampled_addmm"),
}

# (op, variant, dtype) combinations whose forward result on dipu does not agree with CPU, keyed
# "name[variant,dtype]" (tests/device/opinfo_sweep.py's VariantResult.key).
_LCE = ("torch_nn._linear_cross_entropy_batch_chunked_no_reduction is defined after ditorch registers the "
        "shim ahead of composites (at import, for the ops that exist then), so on dipu its composite Python "
        "implementation runs where CPU runs its own kernel: their bf16/fp16 casts differ in the last bit "
        "of a few elements")
COMBINATION_FAILURES: dict[str, str] = {
    **{f"sparse.mm.reduce[function,{d}]": _SPARSE_INPUT.format("_sparse_mm_reduce_impl")
       for d in ("float32", "bfloat16", "float16")},
    "sparse.sampled_addmm[function,float32]": _SPARSE_INPUT.format("sparse_sampled_addmm"),
    "sparse.sampled_addmm[out,float32]": _SPARSE_INPUT.format("sparse_sampled_addmm.out"),
    **{f"nn.functional.linear_cross_entropy.{v}[function,{d}]": _LCE for v in ("chunked", "chunked_none")
       for d in ("bfloat16", "float16")},
    **{f"fft.{name}[out,float32]": (
        f"for one sample PyTorch's CPU fft_{name}.out leaves the out= tensor it is given unwritten (the CPU "
        f"run's out tensor is uninitialized memory too), so the two sides compare garbage")
       for name in ("ihfftn", "ihfft2")},
}

# Differentiable ops whose gradients on dipu do not agree with CPU (forward agrees or is listed above).
GRAD_FAILURES: dict[str, str] = {}

# Ops with positional arguments that must stay on the CPU by the op's own contract (as on CUDA):
# the sweep leaves these sample arguments where they are instead of moving them to dipu.
CPU_ARGUMENTS: dict[str, tuple[str, tuple[int, ...]]] = {
    "tensor_split": (
        "tensor_indices_or_sections, when a tensor, must be a CPU tensor (it is read as host "
        "integers; CUDA requires the same)",
        (0,),
    ),
}
