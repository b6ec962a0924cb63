"""ditorch: train one model on a hyper-heterogeneous fleet of accelerators with PyTorch.

``import ditorch`` is the one line: it loads the device layer (the ``dipu`` device and
``torch.dipu``), registers the ``dicomm`` process-group backend and makes it the default for
``dipu`` tensors.
"""
from __future__ import annotations

import importlib.util

import ditorch_ext
from ditorch_ext import ChipProfile, current as current_chip, set_chip, vendor_name

# DiComm is an optional build product only while it is being developed: without its compiled
# module, ditorch still gives the dipu device, and `ditorch info` says dicomm is unavailable.
if importlib.util.find_spec("dicomm") is not None and importlib.util.find_spec("dicomm._C") is not None:
    import dicomm  # noqa: F401  (registers the backend)

__version__ = "0.1.0"
__all__ = ["ChipProfile", "current_chip", "set_chip", "vendor_name", "__version__"]
