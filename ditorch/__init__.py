"""ditorch: train one model on a hyper-heterogeneous fleet of accelerators with PyTorch.

``import ditorch`` is the one line: it loads the device layer (the ``dipu`` device and
``torch.dipu``), registers the ``dicomm`` process-group backend and makes it the default for
``dipu`` tensors.
"""
from __future__ import annotations

import os

# The device layer. A build without it (a laptop that only plans, a failed compile), or a
# machine without torch, still gives what needs no device: the planner, the simulator, the MRE
# check (and with torch, the parameter server). The device names then raise, saying why the
# layer did not load.
_DEVICE_NAMES = ("ChipProfile", "cpu_fallback_counts", "current_chip", "set_chip", "time_scale", "vendor_name")
device_unavailable: ImportError | None = None
try:
    import ditorch_ext
    from ditorch_ext import ChipProfile, cpu_fallback_counts, current as current_chip, set_chip, time_scale, vendor_name
except ImportError as exc:
    if exc.name not in ("torch", "ditorch_ext", "ditorch_ext._C"):
        raise
    device_unavailable = exc

    def __getattr__(name: str):
        if name in _DEVICE_NAMES:
            raise ImportError(f"ditorch.{name} needs the device layer (ditorch_ext), which did not load: "
                              f"{device_unavailable}. Build it with `make build`.")
        raise AttributeError(f"module 'ditorch' has no attribute {name!r}")

# DiComm registers the backend on import. Only its compiled module (a build without it) or torch
# may be missing: then ditorch still gives the dipu device, and `ditorch info` says why not dicomm.
try:
    import dicomm  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name not in ("torch", "dicomm._C"):
        raise

# Precision tools selected by environment variables apply to unmodified training scripts.
if os.environ.get("DITORCH_TOOLS"):
    import ditorch.tools  # noqa: F401

__version__ = "0.1.0"
__all__ = [*_DEVICE_NAMES, "device_unavailable", "__version__"]
