"""Precision-alignment tools at the ATen dispatch level, and the loss-curve MRE check.

Every op tool is a ``TorchDispatchMode``: it sees each ATen op (backward ops included) on any
device, selects ops by name or regex (``op_selection``), and works as a context manager, a
decorator, or from the ``DITORCH_TOOLS`` environment variable (``env``). Off, it costs nothing.
"""
from ditorch.tools.autocompare import MismatchError, OpComparison, autocompare
from ditorch.tools.capture import ReplayResult, capture, find_captures, load_capture, replay
from ditorch.tools.comparison import DEFAULT_TOLERANCES, Difference, Tolerances, compare
from ditorch.tools.dtype_cast import dtype_cast
from ditorch.tools.env import activate_from_environment
from ditorch.tools.fallback import fallback
from diutil.loss_log import LossLogger, load_losses
from ditorch.tools.mre import MREReport, mean_relative_error, plot_mre
from ditorch.tools.op_selection import FAMILIES, OpSelector, op_names
from ditorch.tools.overflow_check import NonFiniteError, Overflow, TensorStats, overflow_check
from ditorch.tools.time_ops import OpTiming, time_ops

__all__ = [
    "autocompare", "overflow_check", "capture", "time_ops", "dtype_cast", "fallback", "replay",
    "LossLogger", "load_losses", "mean_relative_error", "plot_mre", "MREReport",
    "OpComparison", "MismatchError", "Overflow", "NonFiniteError", "TensorStats", "ReplayResult",
    "OpTiming", "Difference", "Tolerances", "DEFAULT_TOLERANCES", "compare", "OpSelector", "op_names",
    "FAMILIES", "load_capture", "find_captures", "activate_from_environment",
]

activate_from_environment()
