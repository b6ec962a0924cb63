"""A model's layer times on a chip from its datasheet alone: the planner's times for parts that
were never profiled (a fleet named by catalog parts, ``ditorch plan --cluster fleet.yaml``).

The layer is the one the runtime trains (``model_family(spec).stage``, sharded for TP as a rank
of a TP group holds it), run under dipu's bf16 autocast on fake dipu tensors (meta storage), so
nothing is computed or allocated. Every op it
dispatches, forward and backward, is priced as the emulated device prices it (the same C++
counting, ``torch.ops.ditorch_emu.kernel_work``, and csrc/device/KernelCosts.h's roofline): an
emulated chip at time scale 1 and this estimate charge the same kernels the same time, up to
the copies a run makes between host and device.
TP collectives are not kernels here; the cost model adds them from the chip's links
(heteropp/profile.py).

Tracing needs torch and the compiled device layer. Without either (a machine that only plans)
``datasheet_kernel_times`` prices the layer's kernels analytically instead
(``analytic_kernel_times``): the same roofline per kernel, over the matmuls, the attention and
the elementwise passes a LLaMA layer makes, their shapes from the model spec. It agrees with the
traced pricing within a factor of two where the matmuls rule (a 100B layer: it leaves out the
kernels autograd and the framework add; tests/heteropp/test_datasheet_plans.py), and counts
fewer kernels than the trace on small, launch-bound layers: a plan of a fleet is the same kind
of search over somewhat faster layers.
"""
from __future__ import annotations

import dataclasses
import functools

from .model_spec import ModelSpec

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclasses.dataclass(frozen=True)
class KernelTimes:
    """Chip seconds of one micro-batch through one layer, and the kernels behind them; and of
    what a stage's forward does once for all its layers (the position tables)."""

    fwd: float
    bwd: float
    fwd_kernels: int
    bwd_kernels: int
    stage_fwd: float


BF16_BYTES = 2


def datasheet_kernel_times(spec: ModelSpec, tp: int, datasheet) -> KernelTimes:
    """A layer's kernel times on ``datasheet``: traced (``layer_kernel_times``) where torch and
    the device layer load, else analytic (``analytic_kernel_times``)."""
    try:
        import torch  # noqa: F401

        import ditorch_ext  # noqa: F401
    except ImportError:
        return analytic_kernel_times(spec, tp, datasheet)
    return layer_kernel_times(spec, tp, datasheet)


def _roofline_seconds(flops: float, nbytes: float, datasheet, precision: str = "bf16") -> float:
    """One kernel's time on ``datasheet``: its launch plus the longer of compute and memory."""
    compute = flops / datasheet.peak(precision) if flops > 0 else 0.0
    return datasheet.launch_s + max(compute, nbytes / datasheet.memory_bytes_per_s)


def analytic_kernel_times(spec: ModelSpec, tp: int, datasheet) -> KernelTimes:
    """One micro-batch (one sequence) through one layer of ``spec`` on one rank of a TP group of
    ``tp``, in bf16, kernel by kernel with no torch: the seven projections (and their fp32
    weights' casts), the attention's two
    products and softmax, and the elementwise passes (two norms, rotary embedding of q and k,
    SwiGLU's activation and product, two residual adds), each at the roofline of its FLOPs and
    the bytes it reads and writes. The backward runs each projection twice (input and weight
    gradients) and each other kernel once, with half again its forward's traffic (the gradient beside the saved input)."""
    s, h = spec.seq, spec.hidden
    q, kv, f = spec.q_dim // tp, spec.kv_dim // tp, spec.ffn // tp
    b = BF16_BYTES

    def matmul(m: int, k: int, n: int) -> tuple[float, float]:
        return 2.0 * m * k * n, b * (m * k + k * n + m * n)

    shapes = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    projections = [matmul(s, k, n) for k, n in shapes]
    # the runtime keeps fp32 weights: autocast casts each to bf16 in the forward (4 bytes read, 2 written)
    casts = [(0.0, 6.0 * k * n) for k, n in shapes]
    heads = max(1, spec.heads // tp)
    d = spec.head_dim
    attention = [(2.0 * heads * s * s * d, b * heads * (2 * s * d + s * s)),  # q k^T
                 (0.0, 2 * b * heads * s * s),  # softmax
                 (2.0 * heads * s * s * d, b * heads * (s * s + 2 * s * d))]  # scores v
    # (elements read + written) per elementwise pass: norms (x in, y out), rotary (q and k),
    # silu(gate), silu(gate) * up, the two residual adds
    elementwise = [(0.0, b * n) for n in (2 * s * h, 2 * s * h, 2 * s * q, 2 * s * kv, 2 * s * f, 3 * s * f,
                                          3 * s * h, 3 * s * h)]
    fwd = sum(_roofline_seconds(fl, nb, datasheet) for fl, nb in projections + casts + attention + elementwise)
    bwd = sum(2 * _roofline_seconds(fl, nb, datasheet) for fl, nb in projections + attention) + \
        sum(_roofline_seconds(fl, 1.5 * nb, datasheet) for fl, nb in elementwise)
    kernels = len(projections) + len(casts) + len(attention) + len(elementwise)
    return KernelTimes(fwd, bwd, kernels, 2 * (len(projections) + len(attention)) + len(elementwise), 0.0)


def kernel_seconds(op: str, tensors: list, ints: list[int], datasheet) -> float:
    """One op's roofline time on ``datasheet`` (a ``diutil.datasheets.chips.Datasheet``)."""
    import torch

    import ditorch_ext  # noqa: F401  (loads the C++ counting)

    flops, nbytes, precision, launched = torch.ops.ditorch_emu.kernel_work(op, tensors, ints)
    if not launched:
        return 0.0
    compute = flops / datasheet.peak(PRECISIONS[int(precision)]) if flops > 0 else 0.0
    return datasheet.launch_s + max(compute, nbytes / datasheet.memory_bytes_per_s)


def _signature_args(func, args, kwargs) -> tuple[list, list[int]]:
    """The op's tensors and integers in argument order, as the emulated device's shim reads them
    (csrc/device/Shim.cpp, signatureOf)."""
    import torch

    tensors, ints = [], []
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            value = arg.default_value if arg.has_default_value() else None
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) or v is None for v in value):
            tensors.extend(value)
        elif isinstance(value, bool):
            ints.append(int(value))
        elif isinstance(value, int):
            ints.append(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                                for v in value):
            ints.extend(value)
    return tensors, ints


class _Pricing:
    """A TorchDispatchMode that adds up every op's roofline time on one datasheet."""

    def __init__(self, datasheet):
        from torch.utils._python_dispatch import TorchDispatchMode

        pricing = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.namespace != "aten":  # prim::device and the like: no kernel
                    return func(*args, **kwargs)
                tensors, ints = _signature_args(func, args, kwargs)
                seconds = kernel_seconds(func._schema.name, tensors, ints, datasheet)
                pricing.seconds += seconds
                pricing.kernels += seconds > 0
                return func(*args, **kwargs)

        self.mode = Mode()
        self.seconds = 0.0
        self.kernels = 0

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.kernels)
        self.seconds, self.kernels = 0.0, 0
        return out


def _shape_only_group(tp: int):
    """A TP group whose collectives only shape their results: the rank's compute is traced,
    the communication is the cost model's."""
    from heteropp.runtime.tensor_parallel import TPGroup

    class ShapeOnly(TPGroup):
        def all_reduce(self, t, op=None):
            return t

        def all_gather(self, t):
            return t.new_empty((self.size * t.shape[0],) + tuple(t.shape[1:]))

        def reduce_scatter_sequence(self, t):
            return t.new_empty((t.shape[0], t.shape[1] // self.size) + tuple(t.shape[2:]))

    return ShapeOnly(None, tp, 0)


@functools.lru_cache(maxsize=256)
def layer_kernel_times(spec: ModelSpec, tp: int, datasheet, dtype: str = "bf16",
                       sequence_parallel: bool = True) -> KernelTimes:
    """Forward and backward chip seconds of one layer of ``spec`` (one micro-batch of one
    sequence) on one rank of a TP group of ``tp``, its kernels in ``dtype``: a stage of that
    layer less the same stage without it (``stage_fwd``)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import ditorch_ext  # noqa: F401  (the dipu device, its autocast policy and the C++ counting)
    from heteropp.runtime.model_family import model_family

    family = model_family(spec)
    family.check_tp(tp, f"datasheet layer times at TP {tp}")
    layer = min(1, spec.n_layers - 1)
    autocast = torch.autocast("dipu", dtype=torch.bfloat16 if dtype == "bf16" else torch.float16,
                              enabled=dtype != "fp32")
    pricing = _Pricing(datasheet)
    # Fake dipu tensors: meta storage (nothing computed or allocated) that dispatches as dipu, so
    # dipu's autocast casts what a run's autocast casts.
    with FakeTensorMode(allow_non_fake_inputs=False), torch.device("dipu"):
        stage = family.stage((layer, layer + 1), False, False, _shape_only_group(tp),
                             sequence_parallel=sequence_parallel)
        bare = family.stage((layer, layer), False, False, _shape_only_group(tp), sequence_parallel=sequence_parallel)
        local_seq = spec.seq // tp if stage.sp else spec.seq
        x = torch.empty(1, local_seq, spec.hidden, requires_grad=True)
        with pricing.mode, autocast:
            bare(x)
        stage_fwd, stage_kernels = pricing.take()
        with pricing.mode, autocast:
            out = stage(x)
        fwd, fwd_kernels = pricing.take()
        grad = torch.empty_like(out)
        with pricing.mode:
            torch.autograd.backward(out, grad)
        bwd, bwd_kernels = pricing.take()
    return KernelTimes(fwd - stage_fwd, bwd, fwd_kernels - stage_kernels, bwd_kernels, stage_fwd)
