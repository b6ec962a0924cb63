"""DiTorch device layer: the ``dipu`` device on any vendor.

Importing this module loads the C++ runtime, renames PyTorch's PrivateUse1 backend to ``dipu``,
installs ``torch.dipu`` and the ``Tensor.dipu()`` / ``is_dipu`` methods, and applies the chip
profile named by ``DITORCH_CHIP``. ``import ditorch`` does this for you.
"""
from __future__ import annotations

import torch

import ditorch_ext._C as _C  # noqa: E402  (needs torch loaded first; an ImportError here names the module)

_C._init()

from ditorch_ext import device_module  # noqa: E402
from ditorch_ext.chip import configure_from_env, current, set_chip, time_scale  # noqa: E402
from ditorch_ext.profiles import BUILTIN, ChipProfile, known_profiles, load_profile_file  # noqa: E402


def _register() -> None:
    if torch._C._get_privateuse1_backend_name() != "dipu":
        torch.utils.rename_privateuse1_backend("dipu")
    if not hasattr(torch, "dipu"):
        torch._register_device_module("dipu", device_module)
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
        )


_register()
configure_from_env()

from ditorch_ext import shutdown as _shutdown  # noqa: E402

_shutdown.register()  # autograd's dipu device threads finish before the interpreter does

from ditorch_ext import inductor as _inductor  # noqa: E402

_inductor.register()  # torch.compile on dipu (registered when Dynamo and Inductor load)


def vendor_name() -> str:
    """The vendor whose kernels run dipu ops (``emu`` here)."""
    return _C.vendor_name()


def cpu_fallback_counts() -> dict[str, int]:
    """How often each op the vendor lacks ran on the CPU with copies."""
    return dict(_C.cpu_fallback_counts())


def reset_cpu_fallback_counts() -> None:
    _C.reset_cpu_fallback_counts()


def set_unsupported_ops(ops: list[str] | str) -> None:
    """Treat ``ops`` (e.g. ``["aten::mm"]``) as missing from the vendor: they fall back to CPU."""
    _C.set_unsupported_ops(ops if isinstance(ops, str) else ",".join(ops))


__all__ = [
    "BUILTIN", "ChipProfile", "cpu_fallback_counts", "current", "known_profiles", "load_profile_file",
    "reset_cpu_fallback_counts", "set_chip", "set_unsupported_ops", "time_scale", "vendor_name",
]
