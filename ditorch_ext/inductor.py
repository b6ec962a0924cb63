"""``torch.compile`` (Inductor) on dipu: the device registered with Dynamo and Inductor through
PyTorch's extension points for an out-of-tree device.

- Dynamo: a ``DeviceInterface`` for ``dipu`` (``torch._dynamo.device_interface``), so graphs over
  dipu tensors trace and guard as on any accelerator.
- Inductor: a backend for the device (``register_backend_for_device``) and its op overrides
  (``register_device_op_overrides``). On a vendor whose device memory the host addresses (emu,
  the cpu vendor) it is Inductor's C++/OpenMP backend for the CPU, unchanged, on dipu tensors:
  buffers are allocated on dipu (the dipu allocator, the chip's capacity), extern kernels (mm,
  convolution, SDPA) are ATen ops that enter the operator shim like any eager op, and the
  generated C++ kernels read and write the dipu memory in place. The wrapper differs from the
  CPU's in one line per kernel call: ``run_kernel`` puts the kernel on the emulated chip's
  timeline (below).

On emu, a generated kernel is charged as the runtime charges an eager kernel (docs/device.md): its
roofline time on the chip's datasheet (launch latency plus the bytes it moves over the memory
bandwidth) times the time scale, from the moment it was launched. So a fused kernel costs its own
work, not the eager ops it replaced. What differs from eager is in docs/compile.md.

Registration is lazy: importing Dynamo costs seconds, so ``import ditorch`` does not. The
registration runs when ``torch._dynamo.device_interface`` and ``torch._inductor.codegen.cpp``
are first imported (a post-import hook), or at once when they already are; so does
FlexAttention's (``ditorch_ext/flex_attention.py``) when ``torch.nn.attention.flex_attention`` is.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

import torch

from ditorch_ext import _C

_DYNAMO = "torch._dynamo.device_interface"
_INDUCTOR = "torch._inductor.codegen.cpp"  # imported by Inductor before it looks up any device's backend
_FLEX = "torch.nn.attention.flex_attention"  # FlexAttention: ditorch_ext/flex_attention.py
_registered: set[str] = set()


def host_addressable() -> bool:
    """Whether Inductor's C++ kernels may run on dipu memory here (they dereference it on the
    host): the emu vendor's unprotected memory, or a native vendor over the CPU."""
    # The native vendor over the CPU answers host_addressable() false (it speaks for every native
    # device alike), yet its memory is the host's; emu's kernel device is the CPU too, but its
    # memory may be closed to the host (DITORCH_EMU_PROTECT_MEMORY).
    return bool(_C.host_addressable()) or (_C.vendor_name() != "emu" and _C.kernel_device_type() == "cpu")


# -- charging generated kernels to the emulated chip ---------------------------------------------


def kernel_bytes(args: tuple) -> int:
    """The bytes a generated kernel moves: every buffer it is handed, once (Inductor's C++
    kernels are pointwise and reduction loops: memory-bound, as the emulated device prices every
    op outside the matmul, attention and convolution families)."""
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def chip_seconds(nbytes: int) -> float:
    """The active chip's roofline time for a memory-bound kernel moving ``nbytes``, launch latency
    included, before the time scale (csrc/device/KernelCosts.h's model)."""
    from ditorch_ext import chip

    sheet = chip.current()[0].datasheet
    return sheet.launch_s + nbytes / sheet.memory_bytes_per_s


def _kernel_name(kernel: Callable, caller: Any) -> str:
    """The name the generated module gives ``kernel`` (``cpp_fused_sin_0``): the compiled
    extension's own is a generic one. Looked up only while a profile runs; the call's form
    stays ``dipu_run_kernel(kernel, *args)``, which Inductor's code cache already holds."""
    for name, value in caller.f_globals.items():
        if value is kernel:
            return name
    return getattr(kernel, "__name__", "inductor_kernel")


def run_kernel(kernel: Callable, *args: Any) -> None:
    """Run one generated kernel on dipu tensors and, on an emulated chip, occupy the chip for it:
    its roofline time (``chip_seconds`` of the bytes it moves) times the time scale, enqueued at
    its launch, before the host runs it (as the operator shim enqueues an eager kernel: the
    host's run overlaps the device's time)."""
    time_scale = _C.chip_slowdown()  # 0: the chip's speed is not emulated
    if time_scale > 0:
        _C.occupy_device(chip_seconds(kernel_bytes(args)) * time_scale)
    if torch.autograd.profiler._is_profiler_enabled:
        # Announced to torch.profiler's dipu session (csrc/device/Profiler.cpp), which puts it on
        # the device's row: the kernel runs outside the dispatcher, where ops are seen.
        with torch.profiler.record_function(f"dipu kernel {_kernel_name(kernel, sys._getframe(1))}"):
            kernel(*args)
        return
    kernel(*args)


# -- Dynamo ---------------------------------------------------------------------------------------


def _register_dynamo() -> None:
    from torch._dynamo import device_interface as di

    class DipuInterface(di.DeviceInterface):
        """``torch.dipu`` as Dynamo asks a device for it."""

        class device:  # noqa: N801 (Dynamo's name)
            def __new__(cls, device: Any) -> Any:
                return torch.dipu.device(device)

        Event = torch.Event
        Stream = torch.Stream

        class Worker:
            @staticmethod
            def set_device(device: int) -> None:
                torch.dipu.set_device(device)

            @staticmethod
            def current_device() -> int:
                return torch.dipu.current_device()

            @staticmethod
            def get_device_properties(device: Any = None) -> Any:
                # Inductor's C++ backend sizes its work by the host's cores, as for the CPU.
                return di.CpuInterface.Worker.get_device_properties(device)

        current_device = staticmethod(torch.dipu.current_device)
        set_device = staticmethod(torch.dipu.set_device)
        device_count = staticmethod(torch.dipu.device_count)
        is_available = staticmethod(torch.dipu.is_available)
        synchronize = staticmethod(torch.dipu.synchronize)
        current_stream = staticmethod(torch.dipu.current_stream)
        set_stream = staticmethod(torch.dipu.set_stream)
        stream = staticmethod(torch.dipu.stream)

        @staticmethod
        def maybe_exchange_device(device: int) -> int:
            previous = torch.dipu.current_device()
            torch.dipu.set_device(device)
            return previous

        exchange_device = maybe_exchange_device

        @staticmethod
        def get_raw_stream(device_index: int) -> int:
            return 0

        @staticmethod
        def get_compute_capability(device: Any = None) -> str:
            return ""

        @staticmethod
        def is_bf16_supported(including_emulation: bool = False) -> bool:
            return True

        @staticmethod
        def is_triton_capable(device: Any = None) -> bool:
            return False

        @staticmethod
        def memory_allocated(device: Any = None) -> int:
            return torch.dipu.memory_allocated(device)

    di.register_interface_for_device("dipu", DipuInterface)


# -- Inductor ---------------------------------------------------------------------------------------


_wrapper_cls: type | None = None


def _wrapper_class() -> type:
    global _wrapper_cls
    if _wrapper_cls is None:
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen

        class DipuWrapperCodegen(PythonWrapperCodegen):
            """The CPU's Python wrapper, every generated kernel called through ``run_kernel``."""

            @staticmethod
            def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: Any,
                       partition_signatures: Any = None) -> Any:
                if is_subgraph:
                    return PythonWrapperCodegen.create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures)
                return DipuWrapperCodegen()

            def write_header(self) -> None:
                super().write_header()
                self.header.writeline("from ditorch_ext.inductor import run_kernel as dipu_run_kernel")

            def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, *, device: Any = None,
                                             triton: bool = True, **kwargs: Any) -> None:
                from torch._inductor.virtualized import V

                device = device or V.graph.get_current_device_or_throw()
                if device.type == "dipu" and not triton:
                    self.writeline(f"dipu_run_kernel({', '.join([kernel_name, *call_args])}){self.ending}")
                    return
                super()._generate_kernel_call_helper(kernel_name, call_args, device=device, triton=triton, **kwargs)

        _wrapper_cls = DipuWrapperCodegen
    return _wrapper_cls


def _register_inductor() -> None:
    from torch._inductor.codegen import common
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides

    class DipuCppScheduling(CppScheduling):
        """Inductor's C++/OpenMP scheduling for the CPU, on dipu memory the host addresses."""

        def __init__(self, scheduler: Any) -> None:
            if not host_addressable():
                raise NotImplementedError(
                    f"torch.compile's Inductor backend on dipu needs device memory the host addresses (the emu "
                    f"vendor without DITORCH_EMU_PROTECT_MEMORY, or the cpu vendor); the '{_C.vendor_name()}' "
                    f"vendor's is not: use torch.compile(..., backend='aot_eager') there")
            super().__init__(scheduler)

    class DipuDeviceOpOverrides(CpuDeviceOpOverrides):
        """What the generated wrapper writes for device management on dipu."""

        def set_device(self, device_idx: int) -> str:
            return f"torch.dipu.set_device({device_idx})"

        def synchronize(self) -> str:
            return "torch.dipu.synchronize()"

        def device_guard(self, device_idx: int) -> str:
            return f"torch.dipu.device({device_idx})"

    _treat_dipu_as_cpu_in_scheduling()
    common.register_device_op_overrides("dipu", DipuDeviceOpOverrides())
    common.register_backend_for_device("dipu", DipuCppScheduling, _wrapper_class())


def _treat_dipu_as_cpu_in_scheduling() -> None:
    """Inductor decides which fusions its C++ backend can take by asking a node ``is_cpu()``
    (``device.type == "cpu"``), and which code generator's rules apply by
    ``get_current_backend()``; every other device is taken for a GPU, whose backends fuse more
    (a reduction with a re-indexed pointwise, mixed-order reductions) than CppScheduling can
    generate. A dipu node over host-addressable memory is generated by CppScheduling, so it
    answers as a CPU node does. (PyTorch has no extension point for "this device's kernels are the
    CPU's"; these predicates are where it asks.)"""
    from torch._inductor import ir, scheduler

    if getattr(scheduler.BaseSchedulerNode.is_cpu, "_dipu", False):
        return

    def node_is_cpu(self: Any) -> bool:
        device = self.get_device()
        return device is not None and device.type in ("cpu", "dipu")

    base_is_cpu = ir.is_cpu

    def ir_is_cpu(x: Any) -> bool:
        return base_is_cpu(x) or ir.get_device_type(x) == "dipu"

    node_is_cpu._dipu = True  # type: ignore[attr-defined]
    scheduler.BaseSchedulerNode.is_cpu = node_is_cpu  # type: ignore[method-assign]
    ir.is_cpu = ir_is_cpu

    # Which code generator a device's kernels take ("cpp", "triton"): every device but the CPU,
    # MPS, XPU and TPU is taken for CUDA's. Modules that imported the function hold their own
    # binding of it, so each is replaced where it is.
    from torch._inductor import utils

    base_backend = utils.get_current_backend

    def current_backend(device_type: str | None = None) -> str:
        from torch._inductor.virtualized import V

        if not device_type:
            device_type = V.graph.get_current_device_or_throw().type
        return base_backend("cpu" if device_type == "dipu" else device_type)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("torch._inductor") \
                and getattr(module, "get_current_backend", None) is base_backend:
            module.get_current_backend = current_backend


# -- lazy registration --------------------------------------------------------------------------------

def _register_flex_attention() -> None:
    from ditorch_ext import flex_attention

    flex_attention.register()


_REGISTRARS = {_DYNAMO: _register_dynamo, _INDUCTOR: _register_inductor, _FLEX: _register_flex_attention}


def _register_now(name: str) -> None:
    if name not in _registered:
        _registered.add(name)
        _REGISTRARS[name]()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a module's registrar right after the module itself has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _REGISTRARS or fullname in _registered:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_now(fullname)

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def register() -> None:
    """Register dipu with Dynamo and Inductor, now for what is imported, else when it is."""
    for name in _REGISTRARS:
        if name in sys.modules:
            _register_now(name)
    if len(_registered) < len(_REGISTRARS) and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
