"""ditorch: train one model on a hyper-heterogeneous fleet of accelerators with PyTorch.

``import ditorch`` is the one line: it loads the device layer (the ``dipu`` device and
``torch.dipu``), registers the ``dicomm`` process-group backend and makes it the default for
``dipu`` tensors.
"""
from __future__ import annotations

import os

import ditorch_ext
from ditorch_ext import ChipProfile, cpu_fallback_counts, current as current_chip, set_chip, vendor_name

# DiComm registers the backend on import. Only its compiled module may be missing (a build
# without it): then ditorch still gives the dipu device, and `ditorch info` says why not dicomm.
try:
    import dicomm  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "dicomm._C":
        raise

# Precision tools selected by environment variables apply to unmodified training scripts.
if os.environ.get("DITORCH_TOOLS"):
    import ditorch.tools  # noqa: F401

__version__ = "0.1.0"
__all__ = ["ChipProfile", "cpu_fallback_counts", "current_chip", "set_chip", "vendor_name", "__version__"]
